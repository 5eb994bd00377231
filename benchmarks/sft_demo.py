"""`make demo-sft`'s data and report.

`data STDLIB --out DIR`: a conversation dataset from Python's standard library. For each module
(its source up to --max-chars characters) and each of up to --per-module public functions with a
docstring, the user gives the module's source as the long context and asks what the function does;
the assistant answers with the docstring's first paragraph. Modules are split by a hash of their
name: held-out modules (--val-share) go to `val.jsonl`, the others to `train.jsonl` (conversations,
`messages`) and `flat.jsonl` (the same conversations rendered with the demo's chat template into
plain text: what a pipeline without loss masks trains on).

`report MASKED FLAT`: the held-out answer loss (the masked validation set's loss over the trained
tokens, the answers) of both runs at each evaluation step, as a Markdown table.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys

TEMPLATE = "tests/assets/chat_templates/demo-bpe.jinja"


def _docstring_answer(doc: str, limit: int) -> str | None:
    """The docstring's first paragraph, on one line, if it is a sentence of useful length."""
    first = doc.strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in first.splitlines()).strip()
    if len(text) < 20 or len(text) > limit:
        return None
    return text


def _context(lines: list[str], node: ast.FunctionDef, limit: int) -> str:
    """The module's source, or, when longer than `limit` characters, the run of whole lines of
    at most that many characters that starts a third of it before the function."""
    text = "".join(lines)
    if len(text) <= limit:
        return text
    first = node.lineno - 1
    while first > 0 and sum(map(len, lines[first : node.lineno])) < limit // 3:
        first -= 1
    out, size = [], 0
    for line in lines[first:]:
        if size + len(line) > limit:
            break
        out.append(line)
        size += len(line)
    return "".join(out)


def module_conversations(path: str, name: str, args) -> list[list[dict]]:
    """Conversations about the public functions of one module."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        answer = _docstring_answer(ast.get_docstring(node) or "", args.max_answer)
        if answer is None:
            continue
        context = _context(lines, node, args.max_chars)
        if answer.split(" ", 1)[0] not in context:  # the answer's text is in the context
            continue
        question = f"{context}\n\nWhat does {name}.{node.name} do?"
        out.append(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        )
        if len(out) == args.per_module:
            break
    return out


SKIP = ("site-packages", "test", "tests", "idle_test", "lib2to3", "ensurepip", "__pycache__")


def _modules(root: str) -> list[str]:
    """The library's modules (relative paths, sorted), without tests and third-party code."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP)
        rel = os.path.relpath(folder, root)
        out += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return sorted(out)


def make_data(args) -> None:
    sys.path.insert(0, os.getcwd())
    from datapipe.ingest.chat import ChatTemplate, find_template

    template = ChatTemplate(find_template(TEMPLATE, None))
    os.makedirs(args.out, exist_ok=True)
    files = {k: open(os.path.join(args.out, f"{k}.jsonl"), "w") for k in ("train", "flat", "val")}
    counts = dict.fromkeys(files, 0)
    for rel in _modules(args.stdlib):
        name = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        held = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) / 16**8 < args.val_share
        for conv in module_conversations(os.path.join(args.stdlib, rel), name, args):
            if held:
                files["val"].write(json.dumps({"messages": conv}) + "\n")
                counts["val"] += 1
            else:
                files["train"].write(json.dumps({"messages": conv}) + "\n")
                files["flat"].write(json.dumps({"text": template.render(conv, False)}) + "\n")
                counts["train"] += 1
    for f in files.values():
        f.close()
    print(f"{counts['train']} training conversations, {counts['val']} held out, in {args.out}")


def make_report(args) -> None:
    def val(path: str) -> dict[int, float]:
        with open(path) as f:
            recs = [json.loads(line) for line in f]
        return {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}

    masked, flat = val(args.masked), val(args.flat)
    lines = [
        "| step | held-out answer loss, with masks | without masks (flattened text) |",
        "| ---: | ---: | ---: |",
    ]
    for step in sorted(set(masked) & set(flat)):
        lines.append(f"| {step} | {masked[step]:.3f} | {flat[step]:.3f} |")
    first = min(set(masked) & set(flat))
    last = max(set(masked) & set(flat))
    lines.append("")
    lines.append(
        f"answer loss from step {first} to {last}: with masks {masked[first]:.3f} -> "
        f"{masked[last]:.3f} ({masked[first] - masked[last]:+.3f} fallen), without "
        f"{flat[first]:.3f} -> {flat[last]:.3f} ({flat[first] - flat[last]:+.3f} fallen)"
    )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.out + ".tmp", args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="write train.jsonl, flat.jsonl and val.jsonl")
    d.add_argument("stdlib")
    d.add_argument("--out", required=True)
    d.add_argument(
        "--max-chars", type=int, default=3000, help="the context: at most this much source"
    )
    d.add_argument("--max-answer", type=int, default=300, help="longest answer (characters)")
    d.add_argument("--per-module", type=int, default=4, help="functions asked about per module")
    d.add_argument("--val-share", type=float, default=0.06, help="share of modules held out")
    r = sub.add_parser("report", help="the held-out answer loss of both runs")
    r.add_argument("masked", help="the masked run's metrics.jsonl")
    r.add_argument("flat", help="the run without masks' metrics.jsonl")
    r.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args()
    make_data(args) if args.cmd == "data" else make_report(args)


if __name__ == "__main__":
    main()
