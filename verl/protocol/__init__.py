"""DataProto, the batch container of the engine, with veRL's names: `from verl.protocol import DataProto, ...`.

One module per job, imported one way only (each imports only the ones listed before it):

- `values`: deep value equality and the merges built on it (`union_tensor_dict`, `union_numpy_dict`, meta_info);
- `rows`: row arithmetic of the row operations (index validation, repeat/chunk/split/padding indices, mini-batches);
- `config`: `DataProtoConfig`, the process-wide auto-padding switch;
- `serialization`: tensors and TensorDicts to plain values and back, and the one-TensorDict form of a DataProto;
- `data_proto`: `DataProto` and `DataProtoItem`;
- `padding`: `pad_dataproto_to_divisor` / `unpad_dataproto`, `fold_batch_dim` / `unfold_batch_dim`;
- `future`: `DataProtoFuture`, the result of a non-blocking worker-group call;
- `collate`: `collate_fn`.
"""

from verl.protocol.collate import collate_fn
from verl.protocol.config import DataProtoConfig
from verl.protocol.data_proto import DataProto, DataProtoItem
from verl.protocol.future import DataProtoFuture
from verl.protocol.padding import (
    DP_PAD_ROWS_KEY,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from verl.protocol.serialization import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
)
from verl.protocol.values import union_numpy_dict, union_tensor_dict

__all__ = [
    "DP_PAD_ROWS_KEY", "DataProto", "DataProtoConfig", "DataProtoFuture", "DataProtoItem", "collate_fn",
    "deserialize_single_tensor", "deserialize_tensordict", "fold_batch_dim", "pad_dataproto_to_divisor",
    "serialize_single_tensor", "serialize_tensordict", "unfold_batch_dim", "union_numpy_dict", "union_tensor_dict",
    "unpad_dataproto",
]  # fmt: skip
