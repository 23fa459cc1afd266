"""The package's structure, checked from its source: imports only go down (no cycle in
the import graph, and no module imports one of a higher layer, a layer being a folder
of the package), the board and the vocabulary below it import neither zmq nor rich, no
module or function is over its length limit, words are decoded only by the decoders,
and no module touches another object's private attributes.

Each check is a function over a package directory, so the tests below first prove that
it fails on a tiny package built to break it, then run it on ``shmhb``.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
from pathlib import Path


import shmhb


PKG_DIR = Path(shmhb.__file__).parent
ROOT = PKG_DIR.parent
#: the modules that know where each bit of a board word sits: the byte map, the bit map
#: (packing and the one decoder) and the judge; the C mirror of them (_native.c, shmhb.h)
#: is not Python.  Everyone else reads words through their named helpers.
DECODERS = frozenset({"board/layout.py", "board/words.py", "board/judge.py"})

#: functions allowed to inline a decoder's shift, with the reason: a call there would
#: cost more than the 5 % the hot path may move (a call is ~20-35 ns).  They shift by
#: layout's named constants only, never by a literal.
HOT_INLINE: dict[str, str] = {
    "board/heartbeat.py:Heartbeat._make_beat": "the pure-Python beat closure (~220 ns a beat): "
                                         "pack_hb(inc, ts_units(now)) inlined",
    "board/localreads.py:LocalReads.slot": "the pure-Python slot read (~390 ns): ts_units and "
                                     "word_tag inlined",
}

#: files whose hex literals are not board words, with the reason
HEX_FILES: dict[str, str] = {
    "net/protocol.py": "the wire frame's own fields: flag bits and struct integer limits",
}

MAX_FUNCTION_LINES = 60

#: functions over MAX_FUNCTION_LINES (``file:qualname``, def line to last line) with their
#: length today as a ceiling: one may shrink (then lower its entry, or remove it once it
#: fits), never grow; a new long function fails.  Split them when next touched.
LONG_FUNCTIONS_FOR_NOW: dict[str, int] = {
}

#: the package's layers, lowest first.  A layer is a folder: a module's layer is the
#: first folder of its path (``board/layout.py`` is in ``board``), a module at the
#: package's top is in ``base``, the package's ``__init__`` is ``package``; so a new
#: module needs no entry here, a new folder does (until then its modules are in no layer).
#:
#: base     the package's shared vocabulary, at its top: errors, statuses, clocks,
#:          rate-limited logging, periodic threads, /proc and time-namespace facts
#: board    the board (``shmhb/board/``): the byte and bit maps and their decoding
#:          (layout, words, judge), the values stored at its doors (address, config,
#:          records), the segment, its locks, reads and writes of its rows, the worker
#:          and reaper APIs on it
#: net      the network half (``shmhb/net/``): the wire protocol, the pinger and what
#:          it is made of
#: agent    the host agent (``shmhb/agent/``): the local death watch and the loop
#:          running both halves
#: testing  seams for tests (``shmhb/testing/``): the fake network, loopback hosts
#: cli      the command and the operator tools (``shmhb/cli/``): status views,
#:          exporter, gc, check, router feeds, the demo
#: kv       what the KV-transfer wrappers share (``shmhb/kv/``): the go-ahead fence and
#:          the consumer's table of loads; imports no serving stack
#: vllm     the vLLM connector (``shmhb/vllm/``, a client of the board like any worker)
#: sglang   the SGLang Mooncake backend's wrapper (``shmhb/sglang/``), the same kind of client
#: package  the package's facade (``shmhb``)
#:
#: each layer with the layers its modules may import (its own included)
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset({"base"}),
    "board": frozenset({"base", "board"}),
    "net": frozenset({"base", "board", "net"}),
    "agent": frozenset({"base", "board", "net", "agent"}),
    "testing": frozenset({"base", "board", "net", "testing"}),
    "cli": frozenset({"base", "board", "net", "agent", "testing", "cli"}),
    # agent: the public Board (``shmhb.agent.embedded.Board``), whose register joins the
    # host's embedded agent, as any worker's does
    "kv": frozenset({"base", "board", "kv"}),
    "vllm": frozenset({"base", "board", "agent", "kv", "vllm"}),
    "sglang": frozenset({"base", "board", "agent", "kv", "sglang"}),
    "package": frozenset({"base", "board", "net", "agent"}),
}

#: the layers that are no folder: the package's top and its ``__init__``
TOP_LAYERS = frozenset({"base", "package"})

#: modules at the package's top that belong to another layer, with the reason
TOP_LEVEL_EXCEPTIONS: dict[str, tuple[str, str]] = {
    "__main__": ("cli", "``python -m shmhb`` needs it there; it only calls ``shmhb.cli.main``"),
}

#: third-party packages that a layer may not import (the board is read inside every
#: worker: it must not pull in a socket library or a terminal UI)
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "base": frozenset({"zmq", "rich", "prometheus_client"}),
    "board": frozenset({"zmq", "rich", "prometheus_client"}),
    "net": frozenset({"rich", "prometheus_client"}),
    "agent": frozenset({"rich", "prometheus_client"}),
}

#: ``module._name`` accesses that are allowed, with the reason.  Only for names of
#: modules the file imports (a private attribute of an object stays forbidden).
ALLOWED_MODULE_PRIVATE: dict[tuple[str, str], str] = {
    ("os", "_exit"): "the documented way to end a forked child without the parent's "
                     "atexit handlers and buffered output",
}

#: files allowed to touch other objects' private attributes, with the reason
ALLOWED_FILES: dict[str, str] = {
    "vllm/mooncake_adapter.py": "the adapter that reaches into vLLM's MooncakeConnector, "
                                "whose caches have no public API; it names each such "
                                "attribute and checks them at startup",
    "vllm/mooncake_pulls.py": "the Mooncake adapter's settlement of pulls, split out of "
                              "mooncake_adapter.py for length; it names what it uses, and "
                              "mooncake_adapter.py checks those at startup",
    "vllm/ascend_adapter.py": "the adapter that reaches into vllm-ascend's "
                              "MooncakeConnectorV1 (pull); it names every internal it "
                              "uses and checks them at startup",
    "vllm/nixl_adapter.py": "the adapter that reaches into vLLM's NixlConnector (pull), "
                            "whose per-request and per-engine state has no public API; "
                            "it names each such attribute and checks them at startup",
}

#: attributes with a leading underscore that are public API by convention
PUBLIC_BY_CONVENTION: dict[str, str] = {
    "_replace": "NamedTuple API (the underscore only avoids clashing with field names)",
    "_asdict": "NamedTuple API",
    "_fields": "NamedTuple API",
    "_make": "NamedTuple API",
}


# -- the checks --------------------------------------------------------------------------

def _modules(pkg_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package's
    ``__init__.py`` is named as the package)."""
    root = pkg_dir.name
    out = {}
    for p in sorted(pkg_dir.rglob("*.py")):
        parts = [root, *p.relative_to(pkg_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _bound_names(path: Path) -> set[str]:
    """The names a module binds at its top level (imports, defs, classes, assignments)."""
    names: set[str] = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def import_graph(pkg_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every ``import`` and ``from``
    statement anywhere in its file (function-level ones included).  ``from . import x``
    is an edge to submodule ``x`` if ``x`` is one (a .py file, or something the package's
    ``__init__`` does not bind, such as a compiled extension), else to the package's
    ``__init__``, which that statement runs and reads ``x`` from."""
    mods = _modules(pkg_dir)
    root = pkg_dir.name
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for me, path in mods.items():
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name == root or a.name.startswith(root + "."):
                        graph[me].add(a.name)
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = package.split(".")
                    if n.level > 1:
                        base = base[: len(base) - n.level + 1]
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                if target != root and not target.startswith(root + "."):
                    continue
                for a in n.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:
                        graph[me].add(sub)
                    elif target in mods and mods[target].name == "__init__.py" \
                            and a.name not in _bound_names(mods[target]):
                        continue  # a submodule that is not a .py file (an extension)
                    else:
                        graph[me].add(target)
        graph[me].discard(me)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path ``[a, b, ..., a]``, or None if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                got = visit(w)
                if got:
                    return got
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            got = visit(v)
            if got:
                return got
    return None


def packages_of(pkg_dir: Path) -> set[str]:
    """The dotted names of the package and its subpackages (each folder with an
    ``__init__.py``)."""
    return {m for m, p in _modules(pkg_dir).items() if p.name == "__init__.py"}


def layer_of(module: str, packages: set[str], root: str,
             may_import: dict[str, frozenset[str]] = MAY_IMPORT,
             exceptions: dict[str, tuple[str, str]] = TOP_LEVEL_EXCEPTIONS) -> str | None:
    """The layer of ``module`` (a dotted name in the package ``root``, whose
    ``packages`` are its folders), from its folder: ``package`` for the package itself, ``base`` for a module at its
    top (but for ``exceptions``), else its first folder's, or None where that folder is
    no layer."""
    if module == root:
        return "package"
    short = module[len(root) + 1:]
    if short in exceptions:
        return exceptions[short][0]
    folder, dot, _ = short.partition(".")
    if not dot and module not in packages:
        return "base"  # a module at the top, not a folder's __init__
    return folder if folder in may_import and folder not in TOP_LAYERS else None


def layer_violations(graph: dict[str, set[str]], root: str, packages: set[str],
                     may_import: dict[str, frozenset[str]] = MAY_IMPORT,
                     exceptions: dict[str, tuple[str, str]] = TOP_LEVEL_EXCEPTIONS) -> list[str]:
    """``a (layer) imports b (layer)`` for every edge of the import graph that goes up or
    sideways to a layer its own may not import, and ``a: in no layer`` for a module in a
    folder that is no layer."""
    where = {m: layer_of(m, packages, root, may_import, exceptions) for m in graph}
    out = [f"{m}: in no layer (its folder is not in MAY_IMPORT)"
           for m in sorted(graph) if where[m] is None]
    for m in sorted(graph):
        mine = where[m]
        if mine is None:
            continue
        for dep in sorted(graph[m]):
            theirs = where.get(dep)
            if theirs is not None and theirs not in may_import[mine]:
                out.append(f"{m} ({mine}) imports {dep} ({theirs})")
    return out


def third_party_imports(pkg_dir: Path, forbidden: dict[str, frozenset[str]],
                        may_import: dict[str, frozenset[str]] = MAY_IMPORT) -> list[str]:
    """``file:line: imports x`` for every import (function-level ones included) of a
    third-party package that the module's layer may not import."""
    root = pkg_dir.name
    packages = packages_of(pkg_dir)
    out = []
    for mod, path in _modules(pkg_dir).items():
        layer = layer_of(mod, packages, root, may_import)
        banned = forbidden.get(layer or "", frozenset())
        for n in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module] if isinstance(n, ast.ImportFrom) and not n.level and n.module else []
            for name in names:
                if name.split(".")[0] in banned:
                    out.append(f"{path.relative_to(pkg_dir)}:{n.lineno}: imports {name}")
    return out


def long_functions(pkg_dir: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``file:qualname`` -> its length in lines (the ``def`` line to its last), for every
    function or method over ``limit`` lines, nested ones included."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, file: str, prefix: str) -> None:
        for n in ast.iter_child_nodes(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_lines = (n.end_lineno or n.lineno) - n.lineno + 1
                if n_lines > limit:
                    out[f"{file}:{prefix}{n.name}"] = n_lines
                walk(n, file, f"{prefix}{n.name}.")
            elif isinstance(n, ast.ClassDef):
                walk(n, file, f"{prefix}{n.name}.")
            else:
                walk(n, file, prefix)

    for p in sorted(pkg_dir.rglob("*.py")):
        walk(ast.parse(p.read_text()), str(p.relative_to(pkg_dir)), "")
    return out


def _word_bit_names(pkg_dir: Path) -> frozenset[str]:
    """The bit-position constants the bit map (``words.py``) defines: *_SHIFT, *_MASK,
    *_BIT, *_BITS."""
    path = pkg_dir / "board/words.py"
    if not path.exists():
        return frozenset()
    names = _bound_names(path)
    return frozenset(n for n in names if n.endswith(("_SHIFT", "_MASK", "_BIT", "_BITS")))


def raw_decodes(pkg_dir: Path, decoders: frozenset[str] = DECODERS,
                hot: dict[str, str] | None = None,
                hex_files: dict[str, str] | None = None) -> list[str]:
    """``file:line: what`` for every hand-made decode of a word outside ``decoders``: a
    shift of a value (``x >> n``; one of constants only, ``1 << 16``, is a number), a
    ``(1 << n) - 1`` mask, a hex literal, a use of the bit map's *_SHIFT / *_MASK / *_BIT
    constants, the time unit written as a number (1048576, 1.048576), a word index by
    hand (``* 8``, ``// 8``, ``hb_index(i) + 1``).  In ``hot`` functions (and those nested
    in them) shifts and the bit map's constants are allowed; shifts by a literal are not."""
    hot = HOT_INLINE if hot is None else hot
    hex_files = HEX_FILES if hex_files is None else hex_files
    bit_names = _word_bit_names(pkg_dir)
    out: list[str] = []

    def literal(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) or (
            isinstance(n, ast.BinOp) and literal(n.left) and literal(n.right)) or (
            isinstance(n, ast.UnaryOp) and literal(n.operand))

    for p in sorted(pkg_dir.rglob("*.py")):
        file = str(p.relative_to(pkg_dir))
        if file in decoders:
            continue
        text = p.read_text()
        if file not in hex_files:
            for tok in tokenize.generate_tokens(io.StringIO(text).readline):
                if tok.type == tokenize.NUMBER and tok.string[:2].lower() == "0x":
                    out.append(f"{file}:{tok.start[0]}: hex literal {tok.string}")

        def visit(node: ast.AST, where: str) -> None:
            for n in ast.iter_child_nodes(node):
                inner = where
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{where}.{n.name}" if where else n.name
                here = f"{file}:{inner}"
                is_hot = any(here == k or here.startswith(k + ".") for k in hot)
                line = getattr(n, "lineno", 0)
                if isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(
                        n.op, (ast.LShift, ast.RShift)):
                    operands = [n.left, n.right] if isinstance(n, ast.BinOp) else [n.target, n.value]
                    if not all(map(literal, operands)) and (not is_hot or literal(operands[1])):
                        out.append(f"{file}:{line}: shift {ast.unparse(n)}")
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and isinstance(
                        n.left, ast.BinOp) and isinstance(n.left.op, ast.LShift) and isinstance(
                        n.right, ast.Constant) and n.right.value == 1:
                    out.append(f"{file}:{line}: mask {ast.unparse(n)}")
                if isinstance(n, ast.Name) and n.id in bit_names and not is_hot:
                    out.append(f"{file}:{line}: bit map constant {n.id}")
                if isinstance(n, ast.Constant) and n.value in (1 << 20, 1.048576) \
                        and not isinstance(n.value, bool):
                    out.append(f"{file}:{line}: time unit as a number {n.value!r}")
                if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.FloorDiv)) \
                        and any(isinstance(o, ast.Constant) and o.value == 8
                                for o in (n.left, n.right)):
                    out.append(f"{file}:{line}: word index by hand {ast.unparse(n)}")
                if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)) \
                        and isinstance(n.left, ast.Call) and isinstance(n.right, ast.Constant) \
                        and ast.unparse(n.left.func).endswith("_index"):
                    out.append(f"{file}:{line}: word index by hand {ast.unparse(n)}")
                visit(n, inner)

        visit(ast.parse(text), "")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def _imported_modules(tree: ast.Module) -> set[str]:
    """Names under which a file imports a module (``import os``, ``import numpy as np``,
    ``from . import locks``)."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and (n.level and not n.module):
            names.update(a.asname or a.name for a in n.names)
    return names


def private_accesses(pkg_dir: Path) -> list[str]:
    """``file:line: expr`` for every ``<x>._name`` where ``<x>`` is not ``self``, ``cls``
    or ``super()``: a private attribute of another object (dunders are not private;
    modules the file imports may be read by ALLOWED_MODULE_PRIVATE only)."""
    out = []
    for p in sorted(pkg_dir.rglob("*.py")):
        if str(p.relative_to(pkg_dir)) in ALLOWED_FILES:
            continue
        tree = ast.parse(p.read_text())
        modules = _imported_modules(tree)
        for n in ast.walk(tree):
            if not isinstance(n, ast.Attribute) or not n.attr.startswith("_"):
                continue
            if n.attr.startswith("__") and n.attr.endswith("__"):
                continue  # dunder
            if n.attr in PUBLIC_BY_CONVENTION:
                continue
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if isinstance(v, ast.Name) and v.id in modules and (v.id, n.attr) in ALLOWED_MODULE_PRIVATE:
                continue
            out.append(f"{p.relative_to(pkg_dir)}:{n.lineno}: {ast.unparse(n)}")
    return out


# -- the checks can fail -----------------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(textwrap.dedent(text))
    return pkg


def test_cycle_check_finds_function_level_and_package_cycles(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "__init__.py": "from .top import Top\nHOOK = 1\n",
        "top.py": "from .low import f\nclass Top: ...\n",
        "low.py": "import os\ndef f():\n    from .top import Top  # the late import still counts\n",
        "leaf.py": "from . import HOOK\n",  # an edge to __init__
        "clean.py": "from . import low\nfrom .low import f\nimport pkg.low\n",
    })
    g = import_graph(pkg)
    assert g["pkg.clean"] == {"pkg.low"}
    assert g["pkg.leaf"] == {"pkg"}
    assert find_cycle(g) == ["pkg.top", "pkg.low", "pkg.top"]
    # through the package: __init__ -> top -> (late) __init__
    (pkg / "low.py").write_text("def f():\n    from . import HOOK\n")
    assert find_cycle(import_graph(pkg)) == ["pkg", "pkg.top", "pkg.low", "pkg"]
    (pkg / "low.py").write_text("def f():\n    from . import _ext  # a compiled submodule\n")
    assert find_cycle(import_graph(pkg)) is None


def test_layer_check_flags_upward_and_unplaced_modules(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "__init__.py": "from .top import T\n",
        "__main__.py": "from .top import T\n",
        "util.py": "",
        "low/__init__.py": "", "low/a.py": "def f():\n    from ..mid import b  # a late upward import still counts\n",
        "mid/__init__.py": "", "mid/b.py": "from ..low import a\nfrom .. import util\n",
        "top/__init__.py": "from ..mid.b import f\nclass T: ...\n",
        "stray/__init__.py": "", "stray/c.py": "from ..top import T\n",
        "side/deep/d.py": "from ...top import T\n",
    })
    may = {"base": frozenset({"base"}), "low": frozenset({"base", "low"}),
           "mid": frozenset({"base", "low", "mid"}), "top": frozenset({"base", "low", "mid", "top"}),
           "side": frozenset({"base", "low", "side"}), "package": frozenset({"top"})}
    exceptions = {"__main__": ("top", "why")}
    g, packages = import_graph(pkg), packages_of(pkg)
    assert {m: layer_of(m, packages, "pkg", may, exceptions) for m in g} == {
        "pkg": "package", "pkg.__main__": "top", "pkg.util": "base", "pkg.low": "low",
        "pkg.low.a": "low", "pkg.mid": "mid", "pkg.mid.b": "mid", "pkg.top": "top",
        "pkg.stray": None, "pkg.stray.c": None, "pkg.side.deep.d": "side"}
    got = layer_violations(g, "pkg", packages, may, exceptions)
    assert got == ["pkg.stray: in no layer (its folder is not in MAY_IMPORT)",
                   "pkg.stray.c: in no layer (its folder is not in MAY_IMPORT)",
                   "pkg.low.a (low) imports pkg.mid.b (mid)",
                   "pkg.side.deep.d (side) imports pkg.top (top)"], got
    # a new module in a layer's folder needs no entry; one at the top is base
    (pkg / "low/e.py").write_text("from ..top import T\n")
    (pkg / "new.py").write_text("from .low import a\n")
    got = layer_violations(import_graph(pkg), "pkg", packages, may, exceptions)
    assert "pkg.low.e (low) imports pkg.top (top)" in got
    assert "pkg.new (base) imports pkg.low.a (low)" in got


def test_third_party_check_follows_the_folders(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"__init__.py": "", "top.py": "import zmq.green\n",
                              "low/__init__.py": "", "low/a.py": "def f():\n    import zmq\n",
                              "high/__init__.py": "", "high/c.py": "import zmq\n"})
    may = {"base": frozenset(), "low": frozenset(), "high": frozenset()}
    got = third_party_imports(pkg, {"low": frozenset({"zmq"}), "base": frozenset({"zmq"})}, may)
    assert got == ["low/a.py:2: imports zmq", "top.py:1: imports zmq.green"], got


def test_the_real_map_refuses_a_wrong_way_import() -> None:
    """The map itself is strict: the board importing the network half, the library
    importing the tools or the test seams, the connector importing the network half all
    fail."""
    graph = import_graph(PKG_DIR)
    for a, b in [("board.layout", "net.protocol"), ("net.pinger", "agent.role"),
                 ("agent.role", "cli.main"), ("net.transport", "testing.network"),
                 ("vllm.guard", "net.pinger"), ("", "cli.main"), ("clock", "board.layout")]:
        bad = {m: set(d) for m, d in graph.items()}
        bad[f"shmhb.{a}".rstrip(".")].add(f"shmhb.{b}")
        got = layer_violations(bad, "shmhb", packages_of(PKG_DIR))
        assert len(got) == 1 and got[0].startswith(f"shmhb.{a}".rstrip(".") + " ("), (a, b, got)


def test_function_length_check_counts_def_to_last_line(tmp_path: Path) -> None:
    body = "    x = 1\n"
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "m.py": ("def ok():\n" + body * 59 + "\n"
                 "class C:\n    async def big(self):\n" + body.replace("    ", "        ") * 60
                 + "\ndef outer():\n    def inner():\n" + "        x = 1\n" * 60
                 + "    return inner\n"),
    })
    assert long_functions(pkg) == {"m.py:C.big": 61, "m.py:outer": 63,
                                   "m.py:outer.inner": 61}


def test_decode_check_flags_hand_made_decodes(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "board/words.py": "TS_SHIFT = 20\nINC_MASK = (1 << 24) - 1\nLEFT_BIT = 1 << 39\n",
        "board/layout.py": "x = 0xFF\ny = 5 >> 1\n",  # a decoder: anything goes
        "m.py": """
            LIMIT = 1 << 16  # a number, not a decode
            MODE = 0o600
            def f(w, b):
                a = w >> 39 & 1
                c = w & ((1 << 40) - 1)
                d = w & 0xF
                e = w & INC_MASK
                g = (w - 1) * 1.048576
                h = b.hb_index(3) + 1
                i = b.off // 8
                w <<= 2
                return a, c, d, e, g, h, i
            def hot(q, now):
                q[0] = now() >> TS_SHIFT
                q[1] = now() >> 20
            """,
    })
    got = [g.split(": ", 1)[1] for g in raw_decodes(pkg, hot={"m.py:hot": "why"}, hex_files={})]
    assert got == [
        "shift w >> 39", "mask (1 << 40) - 1", "hex literal 0xF", "bit map constant INC_MASK",
        "time unit as a number 1.048576", "word index by hand b.hb_index(3) + 1",
        "word index by hand b.off // 8", "shift w <<= 2", "shift now() >> 20",
    ], got
    assert [g for g in raw_decodes(pkg, hot={}, hex_files={}) if "TS_SHIFT" in g] == [
        "m.py:15: bit map constant TS_SHIFT", "m.py:15: shift now() >> TS_SHIFT"]


def test_private_check_flags_other_objects_only(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"__init__.py": "", "m.py": """
        import os
        from collections import namedtuple
        class A:
            def f(self, other):
                self._mine = 1
                super()._base()
                type(self).__name__
                os._exit(0)
                namedtuple("P", "x")(1)._replace(x=2)
                return other._theirs + self.b._deep + os._private_helper
    """})
    got = private_accesses(pkg)
    assert sorted(g.split(": ", 1)[1] for g in got) == ["os._private_helper", "other._theirs",
                                                        "self.b._deep"], got


# -- the package ---------------------------------------------------------------------------

def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(PKG_DIR))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_submodule_imports_the_package_itself() -> None:
    root = PKG_DIR.name
    bad = sorted(m for m, deps in import_graph(PKG_DIR).items() if m != root and root in deps)
    assert not bad, f"import the defining module, not the package: {bad}"


def test_imports_go_down_the_layers() -> None:
    got = layer_violations(import_graph(PKG_DIR), PKG_DIR.name, packages_of(PKG_DIR))
    assert not got, ("imports against the layers (move what is shared down, or give a new "
                     "folder its layer in MAY_IMPORT):\n" + "\n".join(got))


def test_the_lower_layers_import_neither_zmq_nor_rich() -> None:
    got = third_party_imports(PKG_DIR, FORBIDDEN_THIRD_PARTY)
    assert not got, "third-party imports a layer may not make:\n" + "\n".join(got)


def test_no_function_over_the_limit() -> None:
    got = long_functions(PKG_DIR)
    over = {f: n for f, n in got.items() if n > LONG_FUNCTIONS_FOR_NOW.get(f, MAX_FUNCTION_LINES)}
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines, or longer than their "
                      f"LONG_FUNCTIONS_FOR_NOW ceiling (split them): {over}")
    stale = {f: got.get(f) for f, n in LONG_FUNCTIONS_FOR_NOW.items() if got.get(f) != n}
    assert not stale, ("these shrank or fit now: lower their LONG_FUNCTIONS_FOR_NOW entry "
                       f"to the length shown, or remove it (None): {stale}")


def test_words_are_decoded_only_by_the_decoders() -> None:
    got = raw_decodes(PKG_DIR)
    assert not got, ("shifts and masks of words outside " + ", ".join(sorted(DECODERS)) +
                     " (use layout's named helpers):\n" + "\n".join(got))
    src = {f: (PKG_DIR / f.split(":")[0]).read_text() for f in HOT_INLINE}
    stale = [f for f in HOT_INLINE if f"def {f.rsplit('.', 1)[1]}(" not in src[f]]
    assert not stale, f"HOT_INLINE names functions that are gone: {stale}"


def test_no_cross_object_private_access() -> None:
    got = private_accesses(PKG_DIR)
    assert not got, "private attributes of other objects (add a public method):\n" + \
        "\n".join(got)


def test_the_packaged_version_is_read_statically() -> None:
    # setuptools reads `attr:` without importing the package when the module assigns
    # the name a literal; a name only imported there breaks `pip install .` on a fresh
    # machine (the build backend cannot import numpy or zmq yet).
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    spec = cfg["metadata"]["version"]
    assert spec.startswith("attr: "), spec
    module, _, name = spec[len("attr: "):].rpartition(".")
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text())
    literal = [n for n in tree.body if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
               and isinstance(n.value, ast.Constant)]
    assert literal, f"{path.name} does not assign {name} a literal: setup.cfg's {spec!r} fails"


def test_the_package_shows_only_its_public_names() -> None:
    """``dir(shmhb)`` lists __all__ and submodules, nothing leaked by an import (a
    ``from __future__ import annotations`` made ``shmhb.annotations`` look public)."""
    import types

    leaked = [n for n in dir(shmhb) if not n.startswith("_") and n not in shmhb.__all__
              and not isinstance(getattr(shmhb, n), types.ModuleType)]
    assert not leaked, leaked


def test_the_supported_pythons_are_the_ones_checked() -> None:
    """The oldest Python the package claims (``python_requires``) is the one mypy checks
    it for, the one the image ships and the one the README names.  A lower claim installs
    on a Python the code was never checked on (3.10: ``typing.Self`` fails at import, and
    ``concurrent.futures.TimeoutError`` is not the builtin ``TimeoutError`` there)."""
    import configparser
    import re
    import sys

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    claimed = re.fullmatch(r">=\s*3\.(\d+)", cfg["options"]["python_requires"].strip())
    assert claimed, cfg["options"]["python_requires"]
    oldest = f"3.{claimed.group(1)}"
    checked = re.search(r'^python_version = "([\d.]+)"$',
                        (ROOT / "pyproject.toml").read_text(), re.M)
    image = re.search(r"^ARG PYTHON=([\d.]+)$",
                      (ROOT / "packaging/docker/Dockerfile").read_text(), re.M)
    readme = re.search(r"Python ([\d.]+) or newer", (ROOT / "README.md").read_text())
    assert checked and image and readme
    assert (checked.group(1), image.group(1), readme.group(1)) == (oldest,) * 3
    assert sys.version_info[:2] >= tuple(map(int, oldest.split(".")))
