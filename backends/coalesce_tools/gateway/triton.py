"""The gateway's calls to Triton over gRPC: a request of N rows, and a generation stream that can be cancelled."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np

from coalesce_tools.gateway.errors import ApiError, from_triton

#: How long a finished generation's stream may take to end once our side is closed (Triton ends it at once).
END_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Generated:
    """One piece of a generation stream: new text, and whether it is the last."""

    text: str
    final: bool


class Triton:
    """One gRPC channel to Triton, shared by every request of the gateway (unary calls and streams)."""

    def __init__(self, url: str, *, timeout_s: float, on_cancel: Callable[[str], None] = lambda model: None) -> None:
        """Open a channel to ``url`` (``host:port`` of Triton's gRPC endpoint).

        ``on_cancel(model)`` is called for each generation cancelled in Triton (its client went away).
        """
        import grpc
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.grpc import service_pb2_grpc

        self.url = url
        self.timeout_s = timeout_s
        self._on_cancel = on_cancel
        self.client = grpcclient.InferenceServerClient(url)
        # Streams go through the generated stub: the aio client's stream_infer cannot ask for
        # Triton's final-response flag, the one sign that a decoupled model has answered in full.
        self._channel = grpc.aio.insecure_channel(url, options=[("grpc.max_receive_message_length", -1),
                                                                ("grpc.max_send_message_length", -1)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        """Close both channels."""
        await self.client.close()
        await self._channel.close()

    async def live(self) -> bool:
        """Whether Triton answers live.

        Not its readiness: under strict readiness one model that failed to load makes the whole
        server "not ready" while every other model serves, and the gateway serves those.
        """
        from tritonclient.utils import InferenceServerException

        try:
            return bool(await self.client.is_server_live(client_timeout=2.0))
        except InferenceServerException:
            return False

    async def infer(self, model: str, tensors: Mapping[str, np.ndarray], output: str, *, request_id: str = "",
                    parameters: Mapping[str, Any] | None = None) -> np.ndarray:
        """``output`` of one request whose inputs are ``tensors`` (BYTES arrays of objects, rows first).

        Raises:
            ApiError: Triton's error, mapped (the backend's message kept).
        """
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        inputs = []
        for name, value in tensors.items():
            tensor = grpcclient.InferInput(name, list(value.shape), "BYTES")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        try:
            result = await self.client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(output)],
                                             request_id=request_id, parameters=dict(parameters or {}) or None,
                                             client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            raise from_triton(exc.status(), exc.message() or str(exc), model=model) from None
        value = result.as_numpy(output)
        if value is None:
            raise ApiError(500, f"model '{model}' answered without output '{output}'")
        return value

    async def generate(self, model: str, prompt: str, sampling: Mapping[str, Any], *, request_id: str = "",
                       parameters: Mapping[str, Any] | None = None) -> AsyncIterator[Generated]:
        """Stream a generation: text as the model produces it, the prompt excluded.

        ``parameters`` are request parameters sent with it (``tenant``, ``priority_level``:
        the engine queues lower levels first); ``sampling`` goes in ``sampling_parameters``.

        Leaving the iteration early (the client went away) cancels the request in Triton: the
        backend drops it at its next step.

        Raises:
            ApiError: Triton's error, mapped; a stream error carries no status, so its message decides.
        """
        import grpc
        import tritonclient.grpc as grpcclient
        from tritonclient.grpc import _utils

        def tensor(name: str, datatype: str, value: Any) -> Any:
            item = grpcclient.InferInput(name, [1], datatype)
            item.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
            return item

        inputs = [tensor("text_input", "BYTES", prompt.encode("utf-8")), tensor("stream", "BOOL", True),
                  tensor("sampling_parameters", "BYTES", json.dumps(dict(sampling)).encode()),
                  tensor("exclude_input_in_output", "BOOL", True)]
        request = _utils._get_inference_request(
            model_name=model, inputs=inputs, model_version="", request_id=request_id, outputs=None, sequence_id=0,
            sequence_start=False, sequence_end=False, priority=0, timeout=None,
            parameters=dict(parameters or {}) or None)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        answered = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            # Keep our side of the stream open until the model has answered in full.
            await answered.wait()

        call = self._stub.ModelStreamInfer(requests(), timeout=self.timeout_s)
        finished = False  # Triton answered the request in full (or refused it): nothing to cancel
        broken = False  # the stream itself failed: nothing left to cancel either
        try:
            async for response in call:
                if response.error_message:
                    finished = True
                    raise from_triton(None, response.error_message, model=model)
                infer = response.infer_response
                final = infer.parameters["triton_final_response"].bool_param
                text = ""
                if infer.outputs:
                    value = grpcclient.InferResult(infer).as_numpy("text_output")
                    if value is not None and value.size:
                        text = b"".join(bytes(v) for v in value.reshape(-1)).decode("utf-8", errors="replace")
                # Marked before the yield: a caller that stops at the final piece closes this
                # generator there, and must not cancel a request that has answered in full.
                finished = final
                if text or final:
                    yield Generated(text=text, final=final)
                if final:
                    return
            broken = True
            raise ApiError(500, f"model '{model}': the stream ended before its final response")
        except grpc.aio.AioRpcError as exc:
            broken = True
            raise from_triton(str(exc.code()), exc.details() or "", model=model) from None
        finally:
            answered.set()
            if finished:
                await _end(call, min(self.timeout_s, END_TIMEOUT_S))
            elif not broken:
                # The client left before the end (this generator closed, or its task cancelled, which
                # cancels the call too): cancelling the stream cancels the request in Triton.
                call.cancel()
                self._on_cancel(model)


async def _end(call: Any, timeout_s: float) -> None:
    """Let a stream whose request has answered in full end on its own (our side is closed: Triton ends it).

    Neither cancelled nor dropped unfinished (grpc cancels a call it collects): Triton 2.51's
    gRPC frontend can lose a stream's request when a cancel meets its final response
    (triton-inference-server/server#8078), and the model can then never unload.
    """
    import grpc

    try:
        await asyncio.wait_for(call.code(), timeout=timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        call.cancel()
