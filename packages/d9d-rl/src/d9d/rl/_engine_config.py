"""How the embedded engine batches and pages: rows at once, page size, context, pool size, graphs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CompileBackend = Literal["inductor", "aot_eager"]
"""``torch.compile``'s backend for the engine's compiled steps (``EmbeddedEngineConfig.compile_backend``)."""


class EmbeddedEngineConfig(BaseModel):
    """Continuous batching and the paged KV cache of ``EmbeddedRolloutEngine``.

    Attributes:
        max_rows: Most sequences decoding at once; a finished row's slot goes to the next
            waiting prompt.
        page_size: Tokens per KV-cache block; a row takes a block when its tokens reach it.
        max_context: Most tokens (prompt and completion) of one sequence. A completion that
            reaches it ends with ``finish_reason="length"``; a prompt of ``max_context`` tokens or
            more is refused before generation.
        num_blocks: Blocks in the pool of a ``generate`` call. None: enough for ``max_rows`` rows at
            their longest possible length in the call, so no row is ever preempted. Fewer blocks
            cap the cache's memory: when a running row needs a block and none is free, the most
            recently admitted row is preempted (its blocks freed; it is recomputed from its prompt
            and the tokens sampled so far when readmitted). Must hold one row of ``max_context``.
        cuda_graphs: Capture the decode step (rows with one new token: embedding, layers, final
            norm, LM head) in a CUDA graph per batch-size bucket (powers of two up to
            ``max_rows``) and replay it. None: on where the engine's device is CUDA. True on
            another device is refused when the engine is built. Prefills always run eagerly.
        compile_decode: Run the decode step's model part (embedding, layers, final norm, LM head)
            through ``torch.compile`` (Inductor, one graph; any device Inductor supports): the
            elementwise work around the matmuls and the attention op (norms, rotary embedding,
            residual adds, activations, casts) fuses into fewer kernels. With ``cuda_graphs`` a
            bucket's warm-up step compiles and its graph records the compiled kernels. One row
            and the other buckets take a graph each (the row count is a dynamic size), compiled
            once per engine and reused by every pool (after ``sleep`` too). A compiled step's
            attention gets the whole block table (``max_context``'s blocks) on every step. The
            first steps pay the compilation. A model that cannot compile in one graph stops the
            first decode step with an error naming the switch (never a silent eager fall-back).
        compile_prefill: Run the prefills' model part (``forward_paged``) through
            ``torch.compile`` with every size dynamic: eagerly a prefill's time is mostly the
            host launching several hundred small kernels one by one. One row and several rows take
            a graph each, compiled once per engine (the first prefills pay the compilation). A
            model that cannot compile in one graph stops the first prefill with an error naming
            the switch. None: the same as ``compile_decode``.
        compile_backend: The backend of ``compile_decode`` and ``compile_prefill``. ``"inductor"``
            generates the fused kernels. ``"aot_eager"`` traces the same one graph (Dynamo and
            AOTAutograd, so a graph break still stops the first step) and runs its ops eagerly:
            no speed, but it tells whether a failure or a difference comes from Inductor, and it
            compiles in a fraction of the time (on CPU about half).
        few_rows_linear: Run the decode step's linear layers (projections, feed-forward, LM head)
            through d9d-kernels' ``few_rows_linear`` (``FewRowsLinearMode``): a Triton kernel for
            inputs of up to 16 rows, where cuBLAS's tiles leave most of the GPU idle; buckets of
            more rows stay on ``F.linear``. None: on where the engine's device is CUDA and the step
            is captured in CUDA graphs or compiled (both leave no cost of the mode on the host at
            each step; elsewhere the mode would only fall back to ``F.linear``). Prefills never
            use it.
        few_rows_linear_group: With ``few_rows_linear`` on, also run each layer's q/k/v projections
            and its gate/up projections in one launch each (d9d-kernels' ``few_rows_linear_group``
            through ``shared_input_linear``): a one-row decode step at Qwen3-0.6B widths took
            1.24 ms with a launch per linear and 1.07 ms grouped on an H200. The groups take buckets
            of up to 64 rows (at 64 rows one launch for q/k/v was 2.02x cuBLAS's three at that
            width), where the single products are back on cuBLAS. A SwiGLU's gate/up launch also
            applies the activation (``few_rows_swiglu``). False: a launch per linear.
        decode_ahead: While every running row decodes and none can be admitted or needs a
            block that is not free, launch the next decode step before reading the current step's
            tokens on the host: the next step takes them on the device, and the host's reading,
            scheduling and launching overlap the device's work instead of leaving it idle between
            steps. A row that sampled a stop token has the later step's token discarded (its
            completion is unchanged). Off: the host reads every step's tokens before it plans the
            next one.
        prefill_graphs: With ``cuda_graphs``, also run the prefill of one fresh prompt (the usual
            admission: rows finish one at a time) by replaying a CUDA graph captured per width
            bucket (powers of two from 16 to 2048 tokens; the prompt padded, the padding's keys
            and values written to the scratch block and masked). Eagerly such a prefill is a few
            hundred small kernels launched one by one by the host. Several prompts at once, rows
            with tokens already cached and longer prompts run as before. Each width's graph keeps
            its activations in a memory pool of the prefills' own. None: on with CUDA graphs and
            eager prefills (``compile_prefill`` off); at the Qwen3-0.6B width, batch 64 and
            completions to 2048 on an H200 the prefills took 0.30 s of a call instead of 2.58 s.
            True without CUDA graphs is refused.
        fused_pool_write: In the decode step, let the attention kernel write the rows' new keys
            and values into the pool (d9d-kernels' ``paged_decode_attention(new_key=...,
            write_slots=...)``) instead of two ``index_copy_`` launches per layer (57 launches and
            156 us of a 64-row Qwen3-0.6B step on an H200; that step took 3.08 ms with it and
            3.14 ms without). The reference and compiled paths write with ``index_copy_`` either way.
        longest_rows_first: In the decode step, start the attention's programs with the longest
            rows (one sort of the rows' lengths per step for all layers; d9d-kernels'
            ``paged_decode_attention(row_order=...)``), so that no long row runs on alone at the
            end. The kernel alone took 0.5-2% less time at 64 and 256 rollout rows on an H200,
            2-4% with the three splits the heuristic gives ordered rows; the whole 64-row
            Qwen3-0.6B step took 3.35 ms with it and 3.40 ms without on an H100.
        fused_qk_norm_rope: In the decode step, let the attention kernel apply the layers' per-head
            q/k norms and rotation (Qwen3's; d9d-kernels' ``paged_decode_attention(qk_norm_rope=...)``)
            to the queries and the new keys it loads, instead of a ``qk_norm_rope`` launch per layer
            before it (about 1.9 us each in a 64-row Qwen3-0.6B step on an H200). Needs
            ``fused_pool_write``. Layers without such norms are unaffected. Off: the whole 64-row
            Qwen3-0.6B step was no faster with it on an H100 (3.35 ms either way).
        admission_wait_steps: How many forwards a freed slot may stay empty while prompts wait,
            so that the prompts admitted in that window prefill together. A prefill costs the
            host about the same whether it runs one prompt or several (a few hundred kernel
            launches, and the step that takes it cannot run ahead), and rows finish one at a time,
            so admitting at once prefills one prompt per finished row. 0 (the default): a prompt
            is admitted at the first forward after a slot frees. Waiting prompts are admitted at
            once when every one of them fits, or when no row runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows: int = Field(default=256, gt=0)
    page_size: int = Field(default=16, gt=0)
    max_context: int = Field(default=32768, gt=1)
    num_blocks: int | None = Field(default=None, gt=0)
    cuda_graphs: bool | None = None
    compile_decode: bool = False
    compile_prefill: bool | None = None
    compile_backend: CompileBackend = "inductor"
    few_rows_linear: bool | None = None
    few_rows_linear_group: bool = True
    decode_ahead: bool = True
    prefill_graphs: bool | None = None
    fused_pool_write: bool = True
    longest_rows_first: bool = True
    fused_qk_norm_rope: bool = False
    admission_wait_steps: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _qk_norm_rope_with_the_write(self) -> EmbeddedEngineConfig:
        if self.fused_qk_norm_rope and not self.fused_pool_write:
            raise ValueError(
                "fused_qk_norm_rope needs fused_pool_write: the attention kernel normalizes and rotates "
                "the new keys before it writes them into the pool"
            )
        return self

    @model_validator(mode="after")
    def _pool_holds_one_row(self) -> EmbeddedEngineConfig:
        needed = self.blocks_for(self.max_context)
        if self.num_blocks is not None and self.num_blocks < needed:
            raise ValueError(
                f"num_blocks={self.num_blocks} cannot hold one row of max_context={self.max_context} "
                f"tokens at page_size={self.page_size}: it needs at least {needed} blocks"
            )
        return self

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens of one row."""
        return -(-tokens // self.page_size)
