"""Where the executor's backend decisions come from: the selector service (--selector-address, over plaintext,
TLS or mTLS, with a bearer token when the selector wants one) or the same selection code in-process. Either
way the input is one SelectBackendsRequest built from this machine's capability report and the model's
layer spec."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from selection.selector import Selector
from specdec.v1 import selector_pb2, selector_pb2_grpc
from specdec_runtime.client import open_aio_channel
from specdec_runtime.errors import FailedPrecondition, FieldViolation, InvalidArgument, SpecdecError

SELECT_TIMEOUT_SECONDS = 10.0
# gRPC's default reconnect backoff grows to 120 s (1 s, 1.6 s, 2.6 s, ...): after a selector outage the channel
# kept failing calls for seconds once the selector was back. Retry within a second at most instead; and a call
# that finds the channel backing off opens a fresh one (see BackendChooser.choose). gRPC reads its "minimum
# reconnect backoff" as the time a connection attempt is given to finish its handshake, not as a backoff: at
# 100 ms a selector slow to answer (a loaded 2-core CI host) failed LoadModel with "connection attempt timed out
# before receiving SETTINGS frame". A stopped selector still fails at once (the connection is refused).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 5000),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Subchannels of its own: a fresh channel must not inherit the backing-off connection of the one it replaces.
    ("grpc.use_local_subchannel_pool", 1),
)
log = logging.getLogger("specdec.executor")


@dataclass(frozen=True)
class SelectorClientSettings:
    """How the executor's channel to the selector is secured: TLS when `tls_ca` is set, mTLS with a client
    certificate and key too; `auth_token` goes with every call as `authorization: Bearer <token>`."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    server_name: str | None = None
    auth_token: str | None = field(default=None, repr=False)


class SelectorUnavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE


class BackendChooser:
    """`choose` returns the SelectBackendsResponse; raises SpecdecError (in-process) or AioRpcError (remote)
    with the selector's status and details, which LoadModel passes on unchanged, except for failures that
    concern the executor's link to the selector rather than the request: a refused token becomes
    FAILED_PRECONDITION, an unreachable selector (a TLS handshake failure included) UNAVAILABLE, each naming
    the selector's address, so that the executor's caller does not take them for its own."""

    def __init__(
        self, selector_address: str | None = None, client: SelectorClientSettings = SelectorClientSettings()
    ) -> None:
        """Opens the channel now (inside the serving event loop): a bad token or an unreadable certificate
        fails at start, not at the first LoadModel. No connection is made until a call."""
        self.selector_address = selector_address
        self._client = client
        self._local = Selector(cache_size=64)
        self._channel: grpc.aio.Channel | None = self._open() if selector_address is not None else None

    def _open(self) -> grpc.aio.Channel:
        assert self.selector_address is not None
        client = self._client
        return open_aio_channel(
            self.selector_address,
            client.tls_ca,
            client.tls_cert,
            client.tls_key,
            client.server_name,
            client.auth_token,
            flags="--selector-tls",
            options=RECONNECT_OPTIONS,
        )

    @property
    def remote(self) -> bool:
        return self.selector_address is not None

    async def choose(self, request: selector_pb2.SelectBackendsRequest) -> selector_pb2.SelectBackendsResponse:
        """The selector's decision; a refusal names the LoadModel fields the caller sent (see load_request_field)."""
        try:
            return await self._choose(request)
        except SpecdecError as err:
            raise _in_load_request_terms(err) from None
        except grpc.aio.AioRpcError as err:
            refusal = _refusal(err)
            if refusal is None:
                raise
            raise _in_load_request_terms(refusal) from None

    async def _choose(self, request: selector_pb2.SelectBackendsRequest) -> selector_pb2.SelectBackendsResponse:
        if self._channel is None:
            return self._local.select(request)
        if self._channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # The last attempt failed and the channel waits out its backoff, failing every call meanwhile,
            # although the selector may be back: a fresh channel connects now (and fails fast if it is not).
            stale, self._channel = self._channel, self._open()
            await stale.close()
        stub = selector_pb2_grpc.BackendSelectorStub(self._channel)
        try:
            return await stub.SelectBackends(request, timeout=SELECT_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as err:
            explained = self._link_failure(err)
            if explained is None:
                raise
            log.warning("selector call failed: %s", explained.message)
            raise explained from err

    def _link_failure(self, err: grpc.aio.AioRpcError) -> SpecdecError | None:
        """The error that tells the executor's caller its selector link failed; None: the selector's answer."""
        where, details = f"the selector at {self.selector_address}", err.details() or ""
        if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return FailedPrecondition(
                f"{where} refused authentication ({details}): the executor needs the selector's token "
                "(--selector-auth-token or --selector-auth-token-file; default: the executor's own --auth-token)"
            )
        if err.code() is grpc.StatusCode.UNAVAILABLE:
            return SelectorUnavailable(f"{where} is unavailable: {details}")
        if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return SelectorUnavailable(f"{where} did not answer within {SELECT_TIMEOUT_SECONDS:.0f} s")
        return None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


# SelectBackendsRequest fields, the LoadModelRequest fields the executor built them from, and whether the rest of
# the path carries over (the same message on both sides) or not (a layer spec read from a model's config).
LOAD_REQUEST_FIELDS = (
    ("speculative.dflash_config", "draft.dflash_config", True),
    ("speculative.tree", "draft.tree", True),
    ("speculative.draft_layers", "draft.source", False),
    ("speculative.attention_backend", "draft.attention_backend", False),
    ("speculative.num_speculative_tokens", "draft.num_speculative_tokens", False),
    ("speculative.method", "draft.method", False),
    ("speculative", "draft", False),
    ("target_layers.dtype", "dtype", False),
    ("target_layers.block_size", "block_size", False),
    ("target_layers", "target", False),
)


def load_request_field(field: str) -> str:
    """The LoadModelRequest field a SelectBackendsRequest field came from (the caller never sent the latter)."""
    for selector_field, load_field, keeps_rest in LOAD_REQUEST_FIELDS:
        if field == selector_field or field.startswith(selector_field + "."):
            return load_field + field[len(selector_field) :] if keeps_rest else load_field
    return field


def _in_load_request_terms(err: SpecdecError) -> SpecdecError:
    fields = tuple(FieldViolation(load_request_field(v.field), v.description) for v in err.field_violations)
    return type(err)(err.message, fields, err.precondition_violations, err.omitted)


def _refusal(err: grpc.aio.AioRpcError) -> SpecdecError | None:
    """The selector's INVALID_ARGUMENT as an error of ours, with its field violations; None for other codes."""
    if err.code() is not grpc.StatusCode.INVALID_ARGUMENT:
        return None
    fields = []
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            fields += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
    return InvalidArgument(err.details() or "", tuple(fields))
