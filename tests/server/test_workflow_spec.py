"""A TorchServe workflow specification read as TorchServe reads it (server/models/workflows.py):
settings for every model and per model, the DAG's order, its one start node, and what a wrong
specification is told."""

from __future__ import annotations

import pytest
import yaml

from scriptserve.server.models.workflows import WorkflowError, parse_spec

DOG_BREEDS = """
models:
    min-workers: 1
    max-workers: 1
    batch-size: 4
    max-batch-delay: 100
    retry-attempts: 5
    timeout-ms: 300000

    cat_dog_classification:
      url: cat_dog_classification.mar

    dog_breed_classification:
      url: dog_breed_classification.mar
      batch-size: 2

dag:
  pre_processing: [cat_dog_classification, dog_breed_classification]
  cat_dog_classification: [dog_breed_classification]
"""


def test_torchserves_dog_breed_example_reads_as_torchserve_runs_it() -> None:
    nodes, start = parse_spec("dogs", yaml.safe_load(DOG_BREEDS))
    assert start == "pre_processing"
    assert list(nodes) == ["pre_processing", "cat_dog_classification", "dog_breed_classification"]
    pre, cat_dog, breed = nodes.values()
    assert pre.function and pre.model == "dogs__pre_processing"
    assert cat_dog.url == "cat_dog_classification.mar" and cat_dog.settings["batch-size"] == 4
    assert breed.settings["batch-size"] == 2 and breed.retries == 5 and breed.timeout_s == 300.0
    assert breed.parents == ("pre_processing", "cat_dog_classification")
    assert pre.children == ("cat_dog_classification", "dog_breed_classification")


def test_defaults_are_torchserves() -> None:
    nodes, _ = parse_spec("w", {"models": {"m": {"url": "m.mar"}}, "dag": {"f": ["m"]}})
    assert nodes["m"].settings == {
        "min-workers": 1,
        "max-workers": 1,
        "batch-size": 1,
        "max-batch-delay": 50,
        "retry-attempts": 1,
        "timeout-ms": 10000,
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"models": {}}, "needs a `dag`"),
        ({"dag": {"a": ["b"], "c": ["b"]}}, "exactly one start node"),
        ({"dag": {"a": ["b"], "b": ["c"], "c": ["b"]}}, "cycle through b, c"),
        ({"dag": {"a": "b"}}, "must be a list"),
        ({"models": {"m": {"batch-size": 2}}, "dag": {"f": ["m"]}}, "needs a `url`"),
        ({"models": {"batch-size": "8"}, "dag": {"f": ["g"]}}, "'batch-size' must be a whole"),
        ({"dag": {"bad name": ["g"]}}, "invalid model name"),
    ],
)
def test_a_wrong_specification_is_told_what_to_fix(spec: object, message: str) -> None:
    with pytest.raises(WorkflowError, match=message):
        parse_spec("w", spec)
