"""`ts.metrics.metric_type_enum.MetricTypes`: the kinds a TorchServe metric may have."""

from __future__ import annotations

import enum


class MetricTypes(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
