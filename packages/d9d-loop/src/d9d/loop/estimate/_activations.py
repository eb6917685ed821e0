"""Activation bytes of one microbatch: what a layer keeps for backward, what backward adds, the head's."""

from __future__ import annotations

from d9d.loop.estimate._job import MemoryJob


def microbatch_tokens(job: MemoryJob) -> int:
    """Tokens of one microbatch on one rank (context parallelism splits the sequence)."""
    mesh = job.mesh
    split = mesh.context_parallel_shard * mesh.context_parallel_replicate
    return -(-(job.microbatch_size * job.sequence_length) // split)


def layer_forward_bytes(job: MemoryJob, tokens: int, adapted: int) -> int:
    """Everything one decoder layer's forward keeps for its backward, without recompute.

    Per token, in the compute dtype: the attention block's input and normalized input (2 H),
    q, k, v before and after the q/k norm and rotary embedding (2 Q + 2 KV), v (KV) and the
    attention output (Q); the feed-forward block's input and normalized input (2 H), gate, up
    and their product (3 F); one float32 log-sum-exp per head; per LoRA-adapted linear its
    rank-``r`` intermediate; with experts, the token copies sent to and back from them (2 k H).
    Tensor parallelism splits Q, KV and F.
    """
    model, tp = job.model, job.mesh.tensor_parallel
    q = model.num_heads * model.head_dim // tp
    kv = model.num_kv_heads * model.head_dim // tp
    ffn = model.ffn_width // tp
    per_token = model.compute_bytes * (4 * model.hidden_size + 3 * q + 3 * kv + 3 * ffn)
    per_token += 4 * (model.num_heads // tp)
    per_token += model.compute_bytes * 2 * model.experts_per_token * model.hidden_size
    lora = job.lora
    if lora is not None:
        per_token += model.compute_bytes * lora.r * adapted
    return tokens * per_token


def saved_per_layer_bytes(job: MemoryJob, tokens: int, adapted: int) -> int:
    """What one layer keeps from its forward to its backward: only its input under recompute."""
    model = job.model
    if model.activation_checkpointing:
        return tokens * model.compute_bytes * model.hidden_size
    return layer_forward_bytes(job, tokens, adapted)


def backward_working_bytes(job: MemoryJob, tokens: int, adapted: int) -> int:
    """What the backward of one layer adds: its recomputed forward (under recompute) and the
    gradients of its widest intermediates (gate and up: 2 F) and of its input and residual (3 H)."""
    model = job.model
    ffn = model.ffn_width // job.mesh.tensor_parallel
    transients = tokens * model.compute_bytes * (2 * ffn + 3 * model.hidden_size)
    recomputed = layer_forward_bytes(job, tokens, adapted) if model.activation_checkpointing else 0
    return recomputed + transients


def head_bytes(job: MemoryJob, tokens: int, *, head_trained: bool) -> int:
    """The last stage's LM head and loss: the logits of one chunk of tokens (the model's
    ``head_chunk_tokens``; of all tokens without one), the final norm's output and the hidden
    gradient, float32 loss and log-sum-exp per token, and, for a trained head, the kernel's weight
    gradient in the compute dtype."""
    model = job.model
    vocab = model.vocab_size // job.mesh.tensor_parallel
    row = vocab * model.compute_bytes
    chunk = model.head_chunk_tokens
    rows = tokens if chunk is None else chunk(tokens, vocab)
    total = rows * row + 2 * tokens * model.compute_bytes * model.hidden_size + 8 * tokens
    if head_trained:
        total += vocab * model.hidden_size * model.compute_bytes
    return total
