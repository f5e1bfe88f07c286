"""The tasks: one model kind each, behind ``coalesce.core.task.Task``, chosen by the ``task`` parameter."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coalesce.core.errors import ConfigError
from coalesce.core.task import Task
from coalesce.settings import GENERATE_TASK, ModelSettings
from coalesce.tasks.classify.task import ClassifyTask
from coalesce.tasks.embedding.task import EmbeddingTask
from coalesce.tasks.similarity.task import SimilarityTask
from coalesce.tasks.tensor.task import TensorTask

#: Every row task by its name (parameter ``task``); task ``generate`` (``settings.GENERATE_TASK``) runs on
#: ``coalesce.generation``'s engine instead, behind the backend's generate adapter.
TASK_TYPES: dict[str, type[Task]] = {t.name: t for t in (EmbeddingTask, ClassifyTask, SimilarityTask, TensorTask)}


def task_type(settings: ModelSettings) -> type[Task]:
    """The class of the model's task.

    Raises:
        ConfigError: If no such task is built in.
    """
    found = TASK_TYPES.get(settings.task.task)
    if settings.task.task == GENERATE_TASK:
        raise ConfigError(f"model '{settings.model_name}': task '{GENERATE_TASK}' is not a row task: its requests "
                          "go to the generation engine (coalesce.generation.loader.load_engine)")
    if found is None:
        raise ConfigError(f"model '{settings.model_name}': task '{settings.task.task}' is not built in "
                          f"({', '.join(TASK_TYPES)})")
    return found


def create_task(settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> Task:
    """The model's task, its contract checked against ``config`` and its files (tokenizer) loaded from ``version_dir``.

    Raises:
        ConfigError: If the config breaks the task's contract or a file is missing.
    """
    return task_type(settings)(settings, config, version_dir)
