"""Speculative decoding: cheap proposals of the next tokens (n-gram lookup in the sequence itself, or a smaller
draft model), checked by one forward of the target model over all of them (docs/engine.md "Speculative decoding").

Only the config is re-exported here: engine/config.py imports it, and the rest imports engine modules.
"""

from posttrain.engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
