"""MLflow: each committed checkpoint is a ``LoggedModel`` of the active run that points
at stepvault, with no tensor byte uploaded. ``pip install "stepvault[mlflow]"``.

::

    import mlflow, stepvault
    from stepvault.integrations.mlflow import MLflowTracker

    with mlflow.start_run():
        mgr = stepvault.CheckpointManager(
            "ckpts", run="exp1", options=stepvault.ManagerOptions(hooks=(MLflowTracker(),)))
        ...                                      # mgr.save(step, state, metrics=...)
        mgr.close()

    stepvault.restore("models:/m-0123abcd", state)   # what MLflow hands back
    stepvault.restore("models:/classifier@champion", state)

Why a ``LoggedModel``: MLflow 3 models one per checkpoint, with its step and metrics
(``log_metrics(..., model_id=)``), and the registry registers a LoggedModel
(``models:/<model_id>``) as a version. The model is *external*
(``mlflow.model.isExternal``): its MLmodel file (a few hundred bytes, so that the registry
takes it) is the only artifact; its tags name the checkpoint (``stepvault.uri`` =
``stepvault:ROOT#RUN@STEP``, the manifest's BLAKE3, sizes).

The registry: stepvault's registry is the source of truth. :func:`promote` moves a
stepvault alias and sets the MLflow registered-model alias; :func:`sync_registry`
mirrors every version and alias. An alias moved in MLflow itself is refused with the
stepvault command that moves it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..errors import RegistryError
from ..manager.hooks import HookContext
from ..registry import Registry
from ..store import Store
from ._trackers import CommittedCheckpoint, TrackerHook

try:
    import mlflow
    from mlflow import MlflowClient
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "stepvault.integrations.mlflow needs mlflow, which is not installed: "
        'pip install "stepvault[mlflow]"'
    ) from exc

__all__ = ["MLflowTracker", "promote", "resolve_tracker_uri", "sync_registry"]

#: ``model_type`` of the LoggedModels this module creates (search them with it)
MODEL_TYPE = "stepvault-checkpoint"


class MLflowTracker(TrackerHook):
    """After-commit hook: one external ``LoggedModel`` per committed checkpoint.

    Parameters:
        run_id: the MLflow run the checkpoints belong to (default: the run active when
            the manager is built; there must be one).
        tracking_uri: default ``mlflow.get_tracking_uri()`` when the manager is built.
        retries, backoff, close_timeout, max_pending: see ``TrackerHook`` (a tracker down
            never stalls training: the calls run on the hook's thread).
    """

    tracker = "mlflow"

    def __init__(
        self,
        *,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        retries: int = 3,
        backoff: float = 1.0,
        close_timeout: float = 30.0,
        max_pending: int = 64,
    ) -> None:
        super().__init__(
            retries=retries, backoff=backoff, close_timeout=close_timeout, max_pending=max_pending
        )
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._experiment_id: str | None = None
        self._client: MlflowClient | None = None

    def setup(self, context: HookContext) -> None:
        # The active run and the tracking URI are thread-local in MLflow: read them here,
        # on the thread that builds the manager, not on the hook's thread.
        if self.tracking_uri is None:
            self.tracking_uri = mlflow.get_tracking_uri()
        if self.run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise RuntimeError(
                    "MLflowTracker records checkpoints in an MLflow run: build the manager "
                    "inside mlflow.start_run(), or give MLflowTracker(run_id=...)"
                )
            self.run_id = active.info.run_id
            self._experiment_id = active.info.experiment_id
        # The client now (no request is made): making the first one imports MLflow's REST
        # stack, a second of Python that would otherwise run on the hook's thread while
        # the training thread computes.
        self.client()

    def client(self) -> MlflowClient:
        # One client for the hook's life: making one resolves the tracking store (a scan
        # of the installed plugins), Python work that would contend for the GIL with the
        # training thread on every try.
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def record(self, ckpt: CommittedCheckpoint) -> tuple[str, str]:
        from mlflow.entities import Metric

        client = self.client()
        assert self.run_id is not None
        if self._experiment_id is None:
            self._experiment_id = client.get_run(self.run_id).info.experiment_id
        model = log_checkpoint(client, ckpt, self._experiment_id, self.run_id)
        if ckpt.metrics:
            now = int(time.time() * 1000)
            client.log_batch(
                self.run_id,
                metrics=[
                    Metric(k, v, now, ckpt.step, model_id=model.model_id)
                    for k, v in sorted(ckpt.metrics.items())
                ],
            )
        return ui_url(self.tracking_uri, self._experiment_id, model.model_id), model.name

    def __repr__(self) -> str:
        return f"MLflowTracker(run_id={self.run_id!r}, tracking_uri={self.tracking_uri!r})"


def log_checkpoint(
    client: MlflowClient, ckpt: CommittedCheckpoint, experiment_id: str, run_id: str | None
) -> Any:
    """An external, READY ``LoggedModel`` for ``ckpt`` (its MLmodel spec the only
    artifact): what the tracker and :func:`sync_registry` create."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.models.utils import get_external_mlflow_model_spec
    from mlflow.utils.file_utils import TempDir
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    model = client.create_logged_model(
        experiment_id,
        name=f"{ckpt.run}-{ckpt.step}",
        source_run_id=run_id,
        tags={**ckpt.tags(), MLFLOW_MODEL_IS_EXTERNAL: "true"},
        params={"stepvault.ref": ckpt.ref, "stepvault.root": ckpt.root},
        model_type=MODEL_TYPE,
    )
    with TempDir() as tmp:
        get_external_mlflow_model_spec(model).save(tmp.path("MLmodel"))
        client.log_model_artifacts(model.model_id, tmp.path())
    return client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


def ui_url(tracking_uri: str | None, experiment_id: str | None, model_id: str) -> str:
    """Where the MLflow UI shows a LoggedModel (an http tracking server), else its URI."""
    if tracking_uri and tracking_uri.startswith(("http://", "https://")) and experiment_id:
        return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/models/{model_id}"
    return f"models:/{model_id}"


# ---------------------------------------------------------------- resolving what MLflow hands back
def resolve_tracker_uri(uri: str, *, client: MlflowClient | None = None) -> str:
    """``models:/MODEL_ID``, ``models:/NAME@ALIAS``, ``models:/NAME/VERSION`` or
    ``runs:/RUN_ID/...`` -> the ``stepvault:ROOT#RUN@STEP`` it points at (its
    ``stepvault.uri`` tag). Used by ``stepvault.restore(uri, state)``."""
    client = client or MlflowClient()
    body = uri.split(":/", 1)[1].strip("/")
    tags: dict[str, str] = {}
    if uri.startswith("runs:/"):
        raise RegistryError(
            f"{uri!r} names a run, not a checkpoint: an MLflow run logs one LoggedModel per "
            "stepvault checkpoint; restore its models:/<model_id> (mlflow.search_logged_models"
            f"(filter_string=\"source_run_id='{body.split('/')[0]}'\"))"
        )
    if "@" in body:
        name, alias = body.split("@", 1)
        version = client.get_model_version_by_alias(name, alias)
        tags = _version_tags(client, version)
    elif "/" in body:
        name, number = body.rsplit("/", 1)
        tags = _version_tags(client, client.get_model_version(name, number))
    else:
        tags = dict(client.get_logged_model(body).tags)
    if "stepvault.uri" not in tags:
        raise RegistryError(
            f"{uri!r} is not a stepvault checkpoint (no stepvault.uri tag): it was not "
            "logged by stepvault.integrations.mlflow"
        )
    return tags["stepvault.uri"]


def _version_tags(client: MlflowClient, version: Any) -> dict[str, str]:
    tags = dict(version.tags or {})
    # model_id is not kept by every registry backend; the source models:/<id> is
    model_id = getattr(version, "model_id", None) or str(version.source or "").removeprefix(
        "models:/"
    )
    if "stepvault.uri" not in tags and model_id.startswith("m-"):
        tags.update(client.get_logged_model(model_id).tags)
    return tags


# ---------------------------------------------------------------- the registry
def _alias_tag(alias: str) -> str:
    return f"stepvault.alias.{alias}"


def sync_registry(
    root: str | os.PathLike[str] | Store,
    model: str,
    *,
    registered_model: str | None = None,
    client: MlflowClient | None = None,
    experiment_id: str | None = None,
) -> dict[str, int]:
    """Mirror stepvault model ``model`` into MLflow registered model ``registered_model``
    (default: the same name): a version per stepvault version (its source the
    checkpoint's LoggedModel, logged here when the tracker did not log one) and each
    alias. Returns alias -> MLflow version number.

    stepvault's registry is the source of truth. An MLflow alias that stepvault did not
    set (or that was moved in MLflow since) raises :class:`RegistryError` naming the
    ``stepvault promote`` command that moves it; nothing is changed then.
    """
    client = client or MlflowClient()
    name = registered_model or model
    reg = Registry(root)
    mlflow_aliases = _refuse_moved(client, reg, model, name)
    versions = _mirror_versions(client, reg, model, name, experiment_id)
    for alias, version in reg.aliases(model).items():
        number = versions[version]
        if mlflow_aliases.get(alias) != number:
            client.set_registered_model_alias(name, alias, number)
            client.set_registered_model_tag(name, _alias_tag(alias), number)
    for alias in set(mlflow_aliases) - set(reg.aliases(model)):
        client.delete_registered_model_alias(name, alias)  # removed in stepvault
        client.delete_registered_model_tag(name, _alias_tag(alias))
    return {a: int(versions[v]) for a, v in reg.aliases(model).items()}


def _refuse_moved(client: MlflowClient, reg: Registry, model: str, name: str) -> dict[str, str]:
    """The MLflow aliases of ``name`` (alias -> version), the registered model created
    when absent; raises when one was set or moved in MLflow rather than by stepvault."""
    try:
        registered = client.get_registered_model(name)
    except Exception:
        registered = client.create_registered_model(
            name, tags={"stepvault.model": model, "stepvault.root": reg.store.backend.url}
        )
    known = dict(registered.tags or {})
    mlflow_aliases = {a: str(v) for a, v in (registered.aliases or {}).items()}
    for alias, number in mlflow_aliases.items():
        ours = known.get(_alias_tag(alias))
        if ours != number:
            held = reg.aliases(model).get(alias)
            raise RegistryError(
                f"MLflow alias {name}@{alias} points at version {number}, which stepvault "
                f"did not set{f' (it set {ours})' if ours else ''}: stepvault's registry is "
                "the source of truth and is not changed from MLflow. Move the alias with "
                f"'stepvault promote {model} RUN@STEP --alias {alias}' (now "
                f"{f'v{held}' if held else 'unset'} in stepvault) and sync again, or "
                f"delete the MLflow alias"
            )
    return mlflow_aliases


def _mirror_versions(
    client: MlflowClient, reg: Registry, model: str, name: str, experiment_id: str | None
) -> dict[int, str]:
    """stepvault version -> MLflow version number, creating the missing ones."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    from ._trackers import committed_checkpoint

    existing: dict[int, str] = {}
    for mv in client.search_model_versions(f"name='{name}'"):
        tag = (mv.tags or {}).get("stepvault.version")
        if tag is not None:
            existing[int(tag)] = str(mv.version)
    for version in reg.versions(model):
        if version.version in existing:
            continue
        ckpt = committed_checkpoint(reg.store, version.run, version.step)
        logged = _find_logged(client, ckpt, experiment_id)
        mv = client.create_model_version(
            name,
            source=f"models:/{logged.model_id}",
            model_id=logged.model_id,
            tags={**ckpt.tags(), "stepvault.version": str(version.version)},
            run_id=logged.source_run_id,
            description=f"stepvault {model} v{version.version}: {ckpt.uri}",
        )
        existing[version.version] = str(mv.version)
        # the link MLflow's own register_model records: the UI shows it on the model
        linked = json.loads(logged.tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
        linked.append({"name": name, "version": str(mv.version)})
        client.set_logged_model_tags(logged.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(linked)})
    return existing


def _find_logged(client: MlflowClient, ckpt: CommittedCheckpoint, experiment_id: str | None) -> Any:
    """The LoggedModel the tracker logged for ``ckpt`` (same manifest), or a new one."""
    if experiment_id is None:
        experiment_id = _default_experiment(client)
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_logged_models(
        experiment_ids=experiments,
        filter_string=f"tags.`stepvault.manifest_blake3` = '{ckpt.manifest_id}'",
        max_results=1,
    )
    if found:
        return found[0]
    return log_checkpoint(client, ckpt, experiment_id, None)


def _default_experiment(client: MlflowClient) -> str:
    active = mlflow.active_run()
    if active is not None:
        return str(active.info.experiment_id)
    experiment = client.get_experiment_by_name("Default")
    return experiment.experiment_id if experiment is not None else "0"


def promote(
    root: str | os.PathLike[str] | Store,
    model: str,
    target: str | int,
    alias: str,
    *,
    registered_model: str | None = None,
    client: MlflowClient | None = None,
    note: str = "",
) -> int:
    """``Registry(root).promote(model, target, alias)``, then the MLflow alias follows
    (:func:`sync_registry`); returns the MLflow version number the alias now names."""
    client = client or MlflowClient()
    reg = Registry(root)
    _refuse_moved(client, reg, model, registered_model or model)  # before stepvault moves
    reg.promote(model, target, alias, note=note)
    return sync_registry(root, model, registered_model=registered_model, client=client)[alias]
