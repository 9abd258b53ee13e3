"""A request's pin (`pin_s` in its kv_transfer_params): the blocks it loaded or saved, kept in the
host pool's memory for that long, said once where the pool cannot."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvpool.backends.base import Backend
from kvpool.errors import NOT_FOUND, OK, code_name
from kvpool.keys import KeyScheme
from kvpool.vllm.metadata import BlockTask

logger = logging.getLogger(__name__)


class RequestPins:
    """Pins moved blocks through ``backend`` (`Backend.batch_pin`)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._warned = False

    def pin(self, task: BlockTask, schemes: Sequence[KeyScheme], moved: Sequence[bool]) -> None:
        """Keep the task's moved blocks (every value of each: its layers, heads, PP targets) in
        the host pool's memory for its request's ``pin_s``."""
        hashes = [h for h, ok in zip(task.block_hashes, moved) if ok]
        if not task.pin_s or not hashes:
            return
        keys = [k for scheme in schemes for layer in (range(scheme.layers) if scheme.layers else (None,))
                for k in scheme.keys(hashes, layer, task.tenant)]
        codes = self._backend.batch_pin(keys, task.pin_s)
        bad = None if codes is None else next((c for c in codes if c not in (OK, NOT_FOUND)), None)
        if (codes is None or bad is not None) and not self._warned:
            self._warned = True  # a pool without room for pins, or a store that cannot pin: said once
            why = (f"the {self._backend.name} backend cannot pin (a distributed store keeps its own memory)"
                   if codes is None else f"the pool answered {code_name(bad)}")
            logger.warning("kvpool: request %s asked to pin its blocks for %s s; %s", task.req_id, task.pin_s, why)
