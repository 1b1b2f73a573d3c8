"""Alpha-beta cost model fitted on the emulated cluster, and a weak-scaling projection.

Every collective the strategies use costs, on p ranks and a message of n bytes,
``k_alpha(p) * alpha + k_bytes(p, n) / beta``: alpha is the per-message latency (software
and network), beta the bandwidth a rank achieves, fitted as ``beta = eta * R`` with R the
link's nominal rate and eta the share of it the collective gets. One module per step:

* :mod:`.terms` -- each collective's (k_alpha, k_bytes), the emulated token bucket and
  hierarchical reduction;
* :mod:`.fit` -- alpha, eta and the server's reply overlap phi from the probe, and the
  training-shaped loops' synchronisation cost;
* :mod:`.predict` -- the step time of a (strategy, compression) row, and the held-out rows'
  predictions against their measured step times;
* :mod:`.projection` -- weak scaling to 4096 workers on two layouts (MODEL PROJECTIONS, not
  measurements);
* :mod:`.measure` -- the measurement on the emulated cluster (root): the probe
  (:mod:`.probe`, one rank per namespace), the limit row, the local runs, the codecs
  (:mod:`.codec`) and the rows;
* :mod:`.report` -- ``costmodel.json``, ``costmodel.md`` and the projection's PNG;
* ``__main__`` -- the command line.

Usage (from the repository root)::

    sudo .venv/bin/python -m bench.costmodel --measure            # probe + rows, then fit
    .venv/bin/python -m bench.costmodel --fit bench/results/costmodel/costmodel_inputs.json
    easgd-report bench/results/costmodel                          # adds the projection

Outputs in ``--out`` (default ``bench/results/costmodel``): ``costmodel_inputs.json`` (the
measurements), ``costmodel.json`` (fit, predictions, projection), ``costmodel.md`` and
``costmodel_projection.png``.
"""

from bench.costmodel.codec import count_exchange_messages, measure_exchange_codec, model_shapes
from bench.costmodel.fit import (
    LOOP_SHAPES,
    busy_phi,
    cpu_share,
    fit,
    fit_alpha_beta,
    fit_codec_rounds,
    fit_eta_by_p,
    fit_loops,
    fit_ps_loop,
)
from bench.costmodel.measure import kernel_matmuls, parse_workers, probe_sizes, row_meter
from bench.costmodel.predict import (
    codec_seconds,
    fitted_net,
    local_cost,
    predict_rows,
    row_inputs,
    row_label,
    row_options,
    step_time,
)
from bench.costmodel.projection import LAYOUTS, layouts_with, project
from bench.costmodel.report import analyse, markdown
from bench.costmodel.terms import (
    COLLECTIVES,
    allgather_terms,
    broadcast_terms,
    collective_terms,
    collective_time,
    emulated_burst_bytes,
    hierarchical_allreduce_time,
    ps_terms,
    ring_terms,
    round_robin_terms,
    tree_terms,
)

__all__ = [
    "COLLECTIVES",
    "LAYOUTS",
    "LOOP_SHAPES",
    "allgather_terms",
    "analyse",
    "broadcast_terms",
    "busy_phi",
    "codec_seconds",
    "collective_terms",
    "collective_time",
    "count_exchange_messages",
    "cpu_share",
    "emulated_burst_bytes",
    "fit",
    "fit_alpha_beta",
    "fit_codec_rounds",
    "fit_eta_by_p",
    "fit_loops",
    "fit_ps_loop",
    "fitted_net",
    "hierarchical_allreduce_time",
    "kernel_matmuls",
    "layouts_with",
    "local_cost",
    "markdown",
    "measure_exchange_codec",
    "model_shapes",
    "parse_workers",
    "predict_rows",
    "probe_sizes",
    "project",
    "ps_terms",
    "ring_terms",
    "round_robin_terms",
    "row_inputs",
    "row_label",
    "row_meter",
    "row_options",
    "step_time",
    "tree_terms",
]
