"""The metric names a PromQL expression reads, for checking a dashboard's and alert rules'
queries against what the server exports.

Not a PromQL parser (`promtool check rules` parses; see test_dashboard.py): a tokenizer that
tells metric names from everything else that looks like a name. A name is a metric when it is
followed by `{` or `[`, or stands alone as a selector; it is not when it is a function or an
aggregation (followed by `(`), a keyword (`by`, `offset`, `and`, ...), a label name inside
`{...}`, or one of the label lists of `by`, `without`, `on`, `ignoring`, `group_left` and
`group_right`. Strings and range brackets (`[5m]`, `[$__rate_interval]`) are skipped whole.
"""

from __future__ import annotations

import re

# Prometheus's functions (promql/parser/functions.go) and aggregation operators (lex.go).
FUNCTIONS = frozenset(
    [
        "abs",
        "absent",
        "absent_over_time",
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "avg_over_time",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "cos",
        "cosh",
        "count_over_time",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "deg",
        "delta",
        "deriv",
        "exp",
        "floor",
        "histogram_avg",
        "histogram_count",
        "histogram_fraction",
        "histogram_quantile",
        "histogram_stddev",
        "histogram_stdvar",
        "histogram_sum",
        "holt_winters",
        "double_exponential_smoothing",
        "hour",
        "idelta",
        "increase",
        "info",
        "irate",
        "label_join",
        "label_replace",
        "last_over_time",
        "ln",
        "log10",
        "log2",
        "mad_over_time",
        "max_over_time",
        "min_over_time",
        "minute",
        "month",
        "pi",
        "predict_linear",
        "present_over_time",
        "quantile_over_time",
        "rad",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sin",
        "sinh",
        "sort",
        "sort_by_label",
        "sort_by_label_desc",
        "sort_desc",
        "sqrt",
        "stddev_over_time",
        "stdvar_over_time",
        "sum_over_time",
        "tan",
        "tanh",
        "time",
        "timestamp",
        "vector",
        "year",
    ]
)
AGGREGATIONS = frozenset(
    [
        "avg",
        "bottomk",
        "count",
        "count_values",
        "group",
        "limitk",
        "limit_ratio",
        "max",
        "min",
        "quantile",
        "stddev",
        "stdvar",
        "sum",
        "topk",
    ]
)
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"})
# `@ start()` and `@ end()` modifiers read like function calls.
MODIFIER_CALLS = frozenset({"start", "end"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w:]))
  | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![\w:]))
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[(){},@]|=~|!~|!=|==|<=|>=|[-+*/%^=<>])
    """,
    re.VERBOSE,
)


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) for each token but spaces and comments; ValueError on anything else."""
    found: list[tuple[str, str]] = []
    at = 0
    while at < len(expr):
        match = _TOKEN.match(expr, at)
        if match is None:
            raise ValueError(f"cannot read PromQL at {expr[at : at + 20]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            found.append((kind, match.group()))
        at = match.end()
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects; ValueError for a call of an unknown function, for a
    selector by `__name__` (which this cannot resolve), and for unbalanced brackets."""
    toks = tokens(expr)
    names: set[str] = set()
    braces = 0  # inside {...}: label matchers
    label_list_depth: int | None = None  # paren depth of a by/without/on/... label list
    parens = 0
    for i, (kind, text) in enumerate(toks):
        following = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "punct":
            if text == "{":
                braces += 1
            elif text == "}":
                braces -= 1
            elif text == "(":
                parens += 1
            elif text == ")":
                if label_list_depth == parens:
                    label_list_depth = None
                parens -= 1
            if braces < 0 or parens < 0:
                raise ValueError(f"unbalanced brackets in {expr!r}")
            continue
        if kind != "name":
            continue
        if braces:
            if text == "__name__":
                raise ValueError(f"a selector by __name__ is not checked: {expr!r}")
            continue
        if label_list_depth is not None:
            continue
        if text in LABEL_LIST_KEYWORDS:
            if following == "(":
                label_list_depth = parens + 1
            continue
        if text in AGGREGATIONS and following in ("by", "without"):
            continue  # `sum by (le) (...)`: the grouping comes before the operand
        if following == "(":
            if text not in FUNCTIONS | AGGREGATIONS | MODIFIER_CALLS:
                raise ValueError(f"unknown PromQL function {text!r} in {expr!r}")
            continue
        if text.lower() in KEYWORDS:
            continue
        names.add(text)
    if braces or parens:
        raise ValueError(f"unbalanced brackets in {expr!r}")
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.DOTALL)


def variable_metric_names(query: str) -> set[str]:
    """The metric names of a Grafana Prometheus variable query: `label_values(selector,
    label)` reads the selector's metric, `label_values(label)` none; other forms are PromQL
    (`query_result(...)` is unwrapped)."""
    match = _LABEL_VALUES.match(query)
    if match is not None:
        args = match.group("args")
        if "," not in args:
            return set()
        return metric_names(args.rsplit(",", 1)[0])
    inner = re.match(r"^\s*query_result\((?P<expr>.*)\)\s*$", query, re.DOTALL)
    return metric_names(inner.group("expr") if inner else query)
