"""Which models the gateway serves, and how: read from Triton's repository index and each model's config.

No model is named in code. A model's route follows from its task and its declared tensors:
``embedding`` (``TEXT`` in, one vector out) serves ``/v1/embeddings``; a model that takes
``TEXT`` and ``TEXT_PAIR`` and gives one score a row (a cross-encoder under ``classify``, a
bi-encoder scorer) serves ``/v1/rerank`` and ``/v1/score``; ``generate`` serves
``/v1/completions`` and ``/v1/chat/completions``. Tokenizers come from the model's version
folder, the same files the backend loads, so usage counts are the model's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from coalesce.settings import GENERATE_TASK, ModelSettings, SettingsError
from coalesce_tools.gateway.errors import ApiError

EMBEDDINGS: Final = "embeddings"
RERANK: Final = "rerank"
GENERATE: Final = GENERATE_TASK
#: The routes each kind of model serves (``GET /v1/models`` lists them).
ROUTES: Final = {
    EMBEDDINGS: ("/v1/embeddings",),
    RERANK: ("/v1/rerank", "/v2/rerank", "/v1/score"),
    GENERATE: ("/v1/completions", "/v1/chat/completions"),
}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One ready model as the gateway serves it."""

    name: str
    version: str
    #: ``EMBEDDINGS``, ``RERANK``, ``GENERATE``, or None for a model no route fits (listed, not served).
    kind: str | None
    settings: ModelSettings
    #: The output each row's result is read from (``EMBEDDING``, ``SCORES``, ``text_output``).
    output: str
    #: Width of that output (embeddings: the vector's).
    width: int
    version_dir: Path
    created_s: int

    @functools.cached_property
    def text_tokenizer(self) -> Any:
        """The backend's own tokenizer of a text model (truncating as it does): exact usage counts."""
        from coalesce.tasks.text.tokenizer import TextTokenizer

        path = self.version_dir / self.settings.text.tokenizer_file
        if not path.is_file():
            raise ApiError(503, f"model '{self.name}': its tokenizer {path} is not readable by the gateway "
                                "(is --model-repository the folder Triton serves?)")
        return TextTokenizer(path, self.settings.task.max_sequence_length)

    @functools.cached_property
    def chat_tokenizer(self) -> Any:
        """A generate model's tokenizer (transformers): its chat template, and the engine's prompt counts."""
        folder = self.version_dir / self.settings.runtime.torch_model_dir
        if not (folder / "tokenizer.json").is_file():
            raise ApiError(503, f"model '{self.name}': its tokenizer {folder / 'tokenizer.json'} is not readable by "
                                "the gateway (is --model-repository the folder Triton serves?)")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))

    @functools.cached_property
    def prompt_tokenizer(self) -> Any:
        """A generate model's ``tokenizer.json`` as the engine loads it (``tokenizers``): its prompt counts exactly."""
        from tokenizers import Tokenizer

        self.chat_tokenizer  # noqa: B018 - the same check that the file is there
        return Tokenizer.from_file(str(self.version_dir / self.settings.runtime.torch_model_dir / "tokenizer.json"))

    @property
    def max_rows(self) -> int:
        """Rows Triton takes in one request (``max_batch_size``; 0: one request is one row)."""
        return max(1, self.settings.max_batch_size)

    def describe(self) -> dict[str, Any]:
        """The OpenAI model object, with what Coalesce serves it as."""
        return {"id": self.name, "object": "model", "created": self.created_s, "owned_by": "coalesce",
                "coalesce": {"task": self.settings.task.task, "version": self.version,
                             "routes": list(ROUTES.get(self.kind or "", ()))}}


def model_kind(settings: ModelSettings, config: Mapping[str, Any]) -> tuple[str | None, str, int]:
    """The route a model fits, the output it reads and that output's width, from the task and tensors."""
    inputs = {t.get("name") for t in config.get("input") or []}
    outputs = [(str(t.get("name")), [int(d) for d in t.get("dims") or []]) for t in config.get("output") or []]
    task = settings.task.task
    if task == GENERATE:
        return GENERATE, "text_output", 0
    if len(outputs) != 1 or len(outputs[0][1]) != 1:
        return None, "", 0
    name, (width,) = outputs[0]
    if task == "embedding" and inputs == {"TEXT"}:
        return EMBEDDINGS, name, width
    if inputs == {"TEXT", "TEXT_PAIR"} and width == 1:
        return RERANK, name, width
    return None, name, width


class Catalog:
    """The ready models of one Triton server, re-read when a request names one it has not seen."""

    def __init__(self, client: Any, repository: Path, *, refresh_s: float = 1.0, admin_key: str | None = None) -> None:
        """``client``: a ``tritonclient.grpc.aio.InferenceServerClient``; ``repository``: the folder Triton serves.

        ``admin_key`` opens Triton's repository index where ``coalesce serve`` restricts it.
        """
        from coalesce_tools.launcher import ADMIN_HEADER

        self._index_headers = {f"triton-grpc-protocol-{ADMIN_HEADER}": admin_key} if admin_key else None
        self._client = client
        self._repository = repository
        self._refresh_s = refresh_s
        self._models: dict[str, ModelEntry] = {}
        self._read_s = -float("inf")
        self._lock = asyncio.Lock()

    async def refresh(self) -> dict[str, ModelEntry]:
        """Read the index and the configs of ready models not seen at their version yet.

        Raises:
            ApiError: 503 if Triton cannot be reached.
        """
        from tritonclient.utils import InferenceServerException

        async with self._lock:
            try:
                index = await self._client.get_model_repository_index(headers=self._index_headers, as_json=True)
                found: dict[str, ModelEntry] = {}
                for item in index.get("models", []):
                    name, version = str(item.get("name")), str(item.get("version", ""))
                    if item.get("state") != "READY":
                        continue
                    known = self._models.get(name)
                    if known is not None and known.version == version:
                        found[name] = known
                        continue
                    reply = await self._client.get_model_config(name, version, as_json=True)
                    entry = self._entry(name, version, reply.get("config", reply))
                    if entry is not None:
                        found[name] = entry
            except InferenceServerException as exc:
                raise ApiError(503, f"the inference server cannot be reached: {exc.message()}") from None
            self._models = found
            self._read_s = time.monotonic()
            return found

    def _entry(self, name: str, version: str, config: Mapping[str, Any]) -> ModelEntry | None:
        try:
            settings = ModelSettings.from_model_config(config)
        except SettingsError:
            return None  # not a coalesce model (another backend's parameters): listed by Triton, not here
        if config.get("backend") != "coalesce":
            return None
        kind, output, width = model_kind(settings, config)
        return ModelEntry(name=name, version=version, kind=kind, settings=settings, output=output, width=width,
                          version_dir=self._repository / name / version, created_s=int(time.time()))

    async def models(self) -> list[ModelEntry]:
        """Every ready coalesce model, the index re-read if it is older than the refresh interval."""
        if time.monotonic() - self._read_s >= self._refresh_s:
            await self.refresh()
        return sorted(self._models.values(), key=lambda m: m.name)

    async def get(self, name: Any, kind: str, *, param: str = "model") -> ModelEntry:
        """The ready model ``name`` serving ``kind``.

        Raises:
            ApiError: 400 if ``name`` is not a string, 404 if no such model is ready or it serves another kind.
        """
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' is required: the name of a model (GET /v1/models lists them)", param=param)
        entry = self._models.get(name)
        if entry is None and time.monotonic() - self._read_s >= self._refresh_s:
            entry = (await self.refresh()).get(name)
        if entry is None:
            known = ", ".join(m for m, e in self._models.items() if e.kind == kind) or "none"
            raise ApiError(404, f"the model '{name}' does not exist or is not ready (models serving this route: "
                                f"{known})", param=param, code="model_not_found")
        if entry.kind != kind:
            serves = ", ".join(ROUTES.get(entry.kind or "", ())) or "no route of this gateway"
            raise ApiError(400, f"model '{name}' (task {entry.settings.task.task}) does not serve this route; it "
                                f"serves {serves}", param=param, code="model_not_supported")
        return entry
