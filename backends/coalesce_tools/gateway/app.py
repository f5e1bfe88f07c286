"""The gateway's ASGI application: routes, bearer keys, request ids, body limits, errors and metrics."""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from coalesce_tools.gateway import completions, embeddings, rerank
from coalesce_tools.gateway.catalog import Catalog
from coalesce_tools.gateway.errors import ApiError
from coalesce_tools.gateway.fields import read_json
from coalesce_tools.gateway.metrics import GatewayMetrics
from coalesce_tools.gateway.options import GatewayOptions
from coalesce_tools.gateway.triton import Triton

REQUEST_ID_HEADER: Final = "x-request-id"
#: Optional headers a caller may set; passed to the backend as request parameters (the adaptive scheduler reads
#: both; the generate engine queues by priority).
TENANT_HEADER: Final = "x-coalesce-tenant"
PRIORITY_HEADER: Final = "x-coalesce-priority"
#: The largest priority level the header takes (Triton carries it as an int64 request parameter).
MAX_PRIORITY_LEVEL: Final = 2**63 - 1
#: The longest request id echoed as given; a longer one is replaced.
MAX_REQUEST_ID_CHARS: Final = 128

Handler = Callable[[Request, str], Awaitable[Response]]


def json_response(body: Any, status: int = 200) -> Response:
    """``body`` as JSON (numpy arrays serialised as lists by orjson)."""
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json")


class Gateway:
    """One gateway: its options, its channel to Triton, the models it found, its metrics."""

    def __init__(self, options: GatewayOptions) -> None:
        """Nothing connects until the application starts (``lifespan``)."""
        self.options = options
        self.metrics = GatewayMetrics()
        self._triton: Triton | None = None
        self._catalog: Catalog | None = None
        self._keys = tuple(k.encode() for k in options.api_keys)

    @property
    def triton(self) -> Triton:
        """The channel to Triton (open while the application runs)."""
        assert self._triton is not None, "the gateway has not started"
        return self._triton

    @property
    def catalog(self) -> Catalog:
        """The models Triton serves."""
        assert self._catalog is not None, "the gateway has not started"
        return self._catalog

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Open the channel to Triton for the application's life."""
        self._triton = Triton(self.options.triton_grpc_url, timeout_s=self.options.request_timeout_s,
                              on_cancel=lambda model: self.metrics.cancelled.labels(model).inc())
        self._catalog = Catalog(self._triton.client, self.options.model_repository,
                                refresh_s=self.options.catalog_refresh_s, admin_key=self.options.triton_admin_key)
        with contextlib.suppress(ApiError):
            await self._catalog.refresh()  # a Triton not up yet is found at the first request
        try:
            yield
        finally:
            await self._triton.close()

    def application(self) -> Starlette:
        """The ASGI application."""
        routes = [
            Route("/v1/models", self._endpoint("/v1/models", self._models, auth=True), methods=["GET"]),
            Route("/v1/models/{model}", self._endpoint("/v1/models/{model}", self._model, auth=True),
                  methods=["GET"]),
            Route("/v1/embeddings", self._endpoint("/v1/embeddings", self._json(embeddings.handle)),
                  methods=["POST"]),
            Route("/v1/rerank", self._endpoint("/v1/rerank", self._json(rerank.handle_rerank)), methods=["POST"]),
            Route("/v2/rerank", self._endpoint("/v2/rerank", self._json(rerank.handle_rerank)), methods=["POST"]),
            Route("/v1/score", self._endpoint("/v1/score", self._json(rerank.handle_score)), methods=["POST"]),
            Route("/v1/completions", self._endpoint("/v1/completions", self._generate(chat=False)),
                  methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint("/v1/chat/completions", self._generate(chat=True)),
                  methods=["POST"]),
            Route("/health", self._endpoint("/health", self._health, auth=False), methods=["GET"]),
            Route("/metrics", self._endpoint("/metrics", self._metrics, auth=False), methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan,
                         exception_handlers={404: self._not_found, 405: self._not_allowed})

    # -- plumbing shared by every route -----------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, key) for key in self._keys):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'" if not header
                           else "the API key is not valid", code="invalid_api_key")

    def _endpoint(self, route: str, handler: Handler, *, auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            given = request.headers.get(REQUEST_ID_HEADER, "")
            request_id = given if given and len(given) <= MAX_REQUEST_ID_CHARS else uuid.uuid4().hex
            try:
                if auth:
                    self._authorize(request)
                response = await handler(request, request_id)
            except ApiError as exc:
                response = json_response(exc.body(), exc.status)
            except Exception as exc:  # a bug of ours: the client gets a 500 naming it, the gateway goes on
                response = json_response(ApiError(500, f"the gateway failed: {exc!r}").body(), 500)
            response.headers[REQUEST_ID_HEADER] = request_id
            self.metrics.observe(route, response.status_code, time.perf_counter() - started)
            return response

        return endpoint

    @staticmethod
    def _parameters(request: Request) -> dict[str, Any]:
        parameters: dict[str, Any] = {}
        tenant = request.headers.get(TENANT_HEADER)
        if tenant:
            parameters["tenant"] = tenant
        priority = request.headers.get(PRIORITY_HEADER)
        if priority:
            # ASCII digits only: str.isdigit takes superscripts int() refuses; the bound is Triton's int64 parameter.
            if not (priority.isascii() and priority.isdigit()) or int(priority) > MAX_PRIORITY_LEVEL:
                raise ApiError(400, f"header {PRIORITY_HEADER}: {priority!r} is not a whole number from 0 to "
                                    f"{MAX_PRIORITY_LEVEL} (1 is the highest level; 0: the model's default)",
                               param=PRIORITY_HEADER)
            from coalesce.core.protocol import PRIORITY_PARAMETER

            parameters[PRIORITY_PARAMETER] = int(priority)
        return parameters

    def _json(self, handle: Callable[..., Awaitable[dict[str, Any]]]) -> Handler:
        async def handler(request: Request, request_id: str) -> Response:
            body = await read_json(request, self.options.max_body_bytes)
            return json_response(await handle(self, body, request_id, self._parameters(request)))

        return handler

    def _generate(self, *, chat: bool) -> Handler:
        async def handler(request: Request, request_id: str) -> Response:
            body = await read_json(request, self.options.max_body_bytes)
            generation = await completions.prepare(self, body, chat=chat, parameters=self._parameters(request))
            if generation.stream:
                stream, first, _ = await completions.start(self, generation, request_id)
                return StreamingResponse(completions.events(self, generation, request_id, stream, first),
                                         media_type="text/event-stream",
                                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
            answer = await completions.complete(self, request, generation, request_id)
            if answer is None:
                raise ApiError(499, "the client closed the connection; the generation was cancelled")
            return json_response(answer)

        return handler

    # -- routes of their own ----------------------------------------------------------------------------

    async def _models(self, request: Request, request_id: str) -> Response:
        models = await self.catalog.models()
        return json_response({"object": "list", "data": [m.describe() for m in models]})

    async def _model(self, request: Request, request_id: str) -> Response:
        name = request.path_params["model"]
        for model in await self.catalog.models():
            if model.name == name:
                return json_response(model.describe())
        raise ApiError(404, f"the model '{name}' does not exist or is not ready", param="model",
                       code="model_not_found")

    async def _health(self, request: Request, request_id: str) -> Response:
        if await self.triton.live():
            return json_response({"status": "ok"})
        raise ApiError(503, f"Triton at {self.options.triton_grpc_url} does not answer")

    async def _metrics(self, request: Request, request_id: str) -> Response:
        return Response(self.metrics.page(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return json_response(ApiError(404, f"no route {request.method} {request.url.path}: this gateway serves "
                                           "/v1/models, /v1/embeddings, /v1/rerank, /v2/rerank, /v1/score, "
                                           "/v1/completions, /v1/chat/completions").body(), 404)

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return json_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}").body(), 405)


def create_app(options: GatewayOptions) -> Starlette:
    """The gateway's ASGI application for ``options`` (``uvicorn`` serves it)."""
    return Gateway(options).application()
