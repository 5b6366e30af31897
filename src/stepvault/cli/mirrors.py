"""Registry moves mirrored into an experiment tracker's model registry (``--mlflow`` on
``promote`` and ``rollback``): stepvault's registry stays the source of truth."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ..errors import StepvaultError

MlflowOpt = Annotated[
    bool,
    typer.Option(
        "--mlflow",
        help="Mirror the move into MLflow's registered model of the same name "
        "(MLFLOW_TRACKING_URI; stepvault[mlflow]): its alias follows.",
    ),
]


def mlflow_sync(root: str, model: str, *, moved: bool) -> dict[str, int]:
    """MLflow's registered model ``model`` made to mirror stepvault's (alias -> MLflow
    version); raises RegistryError, changing nothing, when an alias was moved in MLflow.
    ``moved``: stepvault's alias has moved already (an MLflow failure then says so)."""
    from ..integrations.mlflow import sync_registry  # the extra: imported only when asked

    try:
        return sync_registry(root, model)
    except StepvaultError:
        raise
    except Exception as exc:  # MLflow's own errors: server down, refused, misconfigured
        state = (
            "stepvault's registry has moved; run the same command with --mlflow again to mirror it"
            if moved
            else "nothing was changed"
        )
        raise StepvaultError(
            f"MLflow ({type(exc).__name__}: {exc}) at MLFLOW_TRACKING_URI="
            f"{os.environ.get('MLFLOW_TRACKING_URI', '(not set)')}: {state}"
        ) from exc
