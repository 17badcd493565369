from __future__ import annotations

import pytest

from posttrain.models.transformer import Transformer
from tests.quant.tiny import tiny_model


@pytest.fixture
def model() -> Transformer:
    return tiny_model()
