"""What one request asks of the pool, through the `kv_transfer_params` of its API request.

    {"prompt": ..., "kv_transfer_params": {"kvpool": {"skip_load": true}}}

Every switch lives under the one `kvpool` key, so a request may carry another connector's
parameters beside it (a PD transfer's `do_remote_decode`, for instance) and kvpool reads only its
own. A value kvpool cannot read is never an error of the request: the request is served with the
instance's defaults and the connector says once why its switches were ignored (a client must not
be able to fail an engine step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvpool.config import REQUEST_PARAMS_KEY as PARAMS_KEY
from kvpool.store.controls import MAX_PIN_S


class RequestControl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's switches; each field's default is the instance's own behaviour."""

    skip_load: bool = False  # do not look this prompt up in the pool (it is computed, or served by vLLM's cache)
    skip_save: bool = False  # save none of this request's blocks (a prompt that must not be pooled)
    # Save the blocks this request fills while it decodes (null: the `save_decode_cache` setting).
    save_decode: bool | None = None
    # Keep the prompt's blocks in the host pool's memory this many seconds after they are saved
    # or loaded (at most the `request_pin_max_s` setting; 0 there: not at all).
    pin_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_PIN_S)] = 0.0


DEFAULT = RequestControl()

# The switches' names, for the errors and the docs check (what each does: docs/configuration.md).
SWITCHES: tuple[str, ...] = RequestControl.__struct_fields__


def request_control(kv_transfer_params: Any) -> tuple[RequestControl, str | None]:
    """The switches a request's `kv_transfer_params` sets, and why they were ignored (None when
    they were read, or there were none)."""
    if not isinstance(kv_transfer_params, Mapping) or PARAMS_KEY not in kv_transfer_params:
        return DEFAULT, None
    given = kv_transfer_params[PARAMS_KEY]
    try:
        return msgspec.convert(given, RequestControl, strict=True), None
    except msgspec.ValidationError as exc:
        return DEFAULT, (f"kv_transfer_params.{PARAMS_KEY}={given!r:.200} is invalid: {exc}; expected an "
                         f"object of {', '.join(SWITCHES)} (pin_s: seconds, the others true or false); the request was served "
                         f"with the instance's defaults")
