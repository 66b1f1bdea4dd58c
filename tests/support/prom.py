"""Reading one sample out of a Prometheus text exposition, by name and a subset of its labels
(the gateway adds `model_name` to every series, so exact label strings are brittle)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_value(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels`; AssertionError if none."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels} in the exposition")
