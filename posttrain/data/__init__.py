"""Datasets for the trainers: row formats, readers, validation, tokenization with loss masks,
packing and collation. See docs/sft.md for the formats and the bad-row policy."""

from posttrain.data.collate import Batch, collate
from posttrain.data.config import DataConfig
from posttrain.data.dataset import build_sft_rows, read_examples, split_holdout
from posttrain.data.formats import FORMATS, detect_format
from posttrain.data.packing import PackedRow, pack_best_fit
from posttrain.data.readers import read_json_rows, read_rows, row_location
from posttrain.data.tokenize import TokenizedRow, tokenize_sft
from posttrain.data.validate import BadRowLog, DataError, RowError

__all__ = [
    "FORMATS",
    "BadRowLog",
    "Batch",
    "DataConfig",
    "DataError",
    "PackedRow",
    "RowError",
    "TokenizedRow",
    "build_sft_rows",
    "collate",
    "detect_format",
    "pack_best_fit",
    "read_examples",
    "read_json_rows",
    "read_rows",
    "row_location",
    "split_holdout",
    "tokenize_sft",
]
