"""Figures of a finished study (Optuna's matplotlib plots), written as PNG files.

Kept apart from the search: nothing here computes a number the JSON reports.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

from ..files import atomic_write_bytes


def write_plots(study: Any, out_dir: Path) -> list[str]:
    """Optimisation history, and parameter importance when there are 2+ parameters; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return written
    plots = [("history.png", ovm.plot_optimization_history)]
    if len({name for t in complete for name in t.params}) >= 2 and len(complete) >= 3:
        plots.append(("importance.png", ovm.plot_param_importances))
    for name, fn in plots:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                ax = fn(study)
            except (ValueError, RuntimeError) as err:  # e.g. importance with constant parameters
                print(f"skipped {name}: {err}")
                continue
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        fig.set_size_inches(7, 4.5)
        fig.tight_layout()
        path = out_dir / name
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        atomic_write_bytes(path, buf.getvalue())  # a kill mid-write never leaves a torn PNG
        written.append(str(path))
    return written


__all__ = ["write_plots"]
