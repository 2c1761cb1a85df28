"""Writes the openAPIV3Schema of a CustomResourceDefinition into this folder, for the manifest
tests to validate custom resources with (tests/docker/test_manifests.py).

    git -C kserve show v0.20.0:config/crd/full/serving.kserve.io_inferenceservices.yaml \\
      | python tests/docker/crds/vendor.py - --repository kserve/kserve --tag v0.20.0 \\
          --commit "$(git -C kserve rev-parse v0.20.0^{commit})" \\
          --path config/crd/full/serving.kserve.io_inferenceservices.yaml

The upstream files are large (KServe's InferenceService CRD is about 2 MB, mostly the
descriptions of the pod fields it repeats for every framework), so two things change and
nothing else: `description`s are stripped, and a subschema that appears more than once is
written once under `$defs`, named by the path of its first use, and referred to by `$ref`
(which validates the same). Output: `<group>_<plural>.yaml`, with the CRD's group, kind and one
schema per served version.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
# Smaller repeats (a `{type: string}` list, a two-field object) cost more as references.
MIN_SHARED_CHARS = 300


def strip_descriptions(schema: Any) -> Any:
    """`schema` without its `description`s (a property that is named `description` stays)."""
    if isinstance(schema, list):
        return [strip_descriptions(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = strip_descriptions(value)
    return out


def _canonical(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _count(schema: Any, counts: Counter[str]) -> None:
    if isinstance(schema, list):
        for item in schema:
            _count(item, counts)
    elif isinstance(schema, dict):
        counts[_canonical(schema)] += 1
        for value in schema.values():
            _count(value, counts)


def share_repeats(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each object schema of at least MIN_SHARED_CHARS that occurs more than once
    moved to `$defs` (under the dotted path of its first occurrence) and replaced by a `$ref`."""
    counts: Counter[str] = Counter()
    _count(schema, counts)
    defs: dict[str, Any] = {}
    names: dict[str, str] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [walk(item, path) for item in node]
        if not isinstance(node, dict):
            return node
        text = _canonical(node)
        shared = path and counts[text] > 1 and len(text) >= MIN_SHARED_CHARS
        if shared and text in names:
            return {"$ref": f"#/$defs/{names[text]}"}
        if shared:
            names[text] = path
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "properties":
                out[key] = {n: walk(sub, f"{path}.{n}".lstrip(".")) for n, sub in value.items()}
            elif key == "items":
                out[key] = walk(value, f"{path}[]" if path else "")
            else:
                out[key] = walk(value, "")
        if not shared:
            return out
        defs[path] = out
        return {"$ref": f"#/$defs/{path}"}

    root = walk(schema, "")
    # A schema that repeats only inside a repeated one is referred to once: put it back.
    while True:
        uses = Counter(_refs([root, defs]))
        once = {name for name in defs if uses[name] == 1}
        if not once:
            break
        inline = {name: defs.pop(name) for name in once}
        root, defs = _inline(root, inline), _inline(defs, inline)
    return {**root, "$defs": dict(sorted(defs.items()))} if defs else root


def _refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [name for item in node for name in _refs(item)]
    if not isinstance(node, dict):
        return []
    if set(node) == {"$ref"}:
        return [node["$ref"].removeprefix("#/$defs/")]
    return [name for value in node.values() for name in _refs(value)]


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"$ref"} and node["$ref"].removeprefix("#/$defs/") in defs:
        return _inline(defs[node["$ref"].removeprefix("#/$defs/")], defs)
    return {key: _inline(value, defs) for key, value in node.items()}


def vendor(crd: dict[str, Any], source: dict[str, str]) -> tuple[str, str]:
    """(file name, text) of the schemas of `crd`, with a header that names `source`
    (repository, path, commit and tag)."""
    spec = crd["spec"]
    versions = {
        v["name"]: share_repeats(strip_descriptions(v["schema"]["openAPIV3Schema"]))
        for v in spec["versions"]
        if v.get("served", True)
    }
    body = {"group": spec["group"], "kind": spec["names"]["kind"], "versions": versions}
    tag = f" (tag {source['tag']})" if source.get("tag") else ""
    header = (
        f"# The openAPIV3Schema of the {spec['names']['kind']} CustomResourceDefinition "
        f"({spec['group']}, {', '.join(versions)}).\n"
        f"# Source: https://github.com/{source['repository']}, {source['path']},\n"
        f"# commit {source['commit']}{tag}.\n"
        "# License: Apache License, Version 2.0 (https://www.apache.org/licenses/LICENSE-2.0),\n"
        "# as the source repository's LICENSE file states.\n"
        "# Modified by tests/docker/crds/vendor.py, which wrote this file: descriptions stripped,\n"
        "# repeated subschemas moved to $defs (named by the path of their first use) and\n"
        "# referred to by $ref. Nothing else changed.\n"
    )
    text = yaml.safe_dump(body, sort_keys=False, width=100, default_flow_style=None)
    return f"{spec['group']}_{spec['names']['plural']}.yaml", header + text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd", help="the CRD's YAML file, or - for standard input")
    parser.add_argument("--repository", required=True, help="owner/name on GitHub")
    parser.add_argument("--path", required=True, help="the file's path in the repository")
    parser.add_argument("--commit", required=True, help="the commit it was read at")
    parser.add_argument("--tag", help="the release tag of that commit")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.crd == "-" else Path(args.crd).read_text()
    source = {"repository": args.repository, "path": args.path, "commit": args.commit}
    if args.tag:
        source["tag"] = args.tag
    name, vendored = vendor(yaml.safe_load(text), source)
    (HERE / name).write_text(vendored)
    sys.stdout.write(f"wrote {HERE / name} ({len(vendored)} characters)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
