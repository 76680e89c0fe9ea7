"""The function of one layer that the parallel machinery runs (the pipeline's stages, ZeRO-3's
gather): (one layer's params, x_btd, side) -> y_btd. `side`: the micro-batch's per-row arrays
([b, t] each: segment ids, positions, ...), a dict, possibly empty; the pipeline hands each unit of
work those of the micro-batch it works on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

LayerFn = Callable[[Any, jax.Array, dict], jax.Array]
Side = dict[str, jax.Array]
