"""d9d state mappers: stream checkpoints through mapper graphs in bounded memory."""

from d9d.state_mappers._cast import CastMapper
from d9d.state_mappers._checkpoint_reader import SafetensorsCheckpoint
from d9d.state_mappers._concat import ChunkMapper, ConcatenateMapper
from d9d.state_mappers._convert import convert_checkpoint
from d9d.state_mappers._drop import DropMapper
from d9d.state_mappers._dtensor import DistributeMapper, GatherMapper
from d9d.state_mappers._errors import CheckpointFormatError, StateMappingError
from d9d.state_mappers._filter import FilterMapper
from d9d.state_mappers._from_module import identity_mapper_from_module
from d9d.state_mappers._group import GroupPlan, MapperGroup, StateMapper
from d9d.state_mappers._in_memory import map_state_dict
from d9d.state_mappers._load import load_module_state
from d9d.state_mappers._parallel import ParallelMapper
from d9d.state_mappers._permute import PermuteMapper, TransposeMapper
from d9d.state_mappers._prefix import PrefixMapper
from d9d.state_mappers._rename import IdentityMapper, RenameMapper, SelectMapper
from d9d.state_mappers._reshape import ReshapeMapper
from d9d.state_mappers._save import save_module_state
from d9d.state_mappers._sequential import SequentialMapper
from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec
from d9d.state_mappers._stack import StackMapper, UnstackMapper
from d9d.state_mappers._unary import UnaryMapper
from d9d.state_mappers._validation import ValidatedMapping, validate_mapping

__all__ = [
    "Box",
    "CastMapper",
    "CheckpointFormatError",
    "ChunkMapper",
    "ConcatenateMapper",
    "DistributeMapper",
    "DropMapper",
    "FilterMapper",
    "GatherMapper",
    "GroupPlan",
    "IdentityMapper",
    "MapperGroup",
    "ParallelMapper",
    "PermuteMapper",
    "PrefixMapper",
    "RenameMapper",
    "ReshapeMapper",
    "SafetensorsCheckpoint",
    "SelectMapper",
    "SequentialMapper",
    "StackMapper",
    "StateMapper",
    "StateMappingError",
    "TensorPiece",
    "TensorSpec",
    "TransposeMapper",
    "UnaryMapper",
    "UnstackMapper",
    "ValidatedMapping",
    "convert_checkpoint",
    "identity_mapper_from_module",
    "load_module_state",
    "map_state_dict",
    "save_module_state",
    "validate_mapping",
]
