"""The package layout's import graph, read from the source (ast), not from what one run happens to import.

The services stand apart: the selector, the executor and the gateway each build on the shared packages (specdec_runtime,
selection, kernels, the specdec stubs) and never import the other service or the CLI; the shared packages import
no service. The selector's side stays torch-free, so that its image runs without torch.

Inside the executor, every module belongs to one layer of EXECUTOR_LAYERS, bottom to top, and imports only
modules of its own layer or of lower ones (imports for annotations alone, under `if TYPE_CHECKING:`, included):

- base: what every layer uses (the engine's plain errors, device helpers, cancellation, the TP shared-memory ring);
- models: model shapes and code, checkpoint and GGUF loading, drafter shapes and weights, TP sharding;
- sampling: the target distribution, penalties, logprobs, sampling settings as tensors;
- engine core: requests and their KV-cache bookkeeping (block pool, prefix cache, KV cache, scheduler);
- runner: the model runner, CUDA graphs, the tensor-parallel driver;
- spec decode: drafting, verification and the device step (its sampling variants and penalty table);
- engine: the engine thread and its one step (chains and trees alike, and the overlapped target-only decode);
- server: the gRPC shell, request checks, the wire conversions (wire.py), the composition root (session.py).

The drafter trainer, specdec_training, is an offline tool beside the services: it builds on the executor's layers
below the server (models to load and train against, the engine to generate with) and on the capability report the
selector decides from, never on the gRPC shell or the composition root; of the stubs it reads only what
TRAINING_READING_THE_WIRE grants, and no executor module imports it. No module of executor_service.parallel imports
the composition root (a rank loads through model_loading.py and wire.py).

Protobuf stops in the server layer: base, sampling, engine core, runner, spec decode and engine ("wire-free")
never import the stubs, grpc, google.rpc or specdec_runtime (whose errors are gRPC statuses); they raise the
engine's own errors (executor_service/errors.py), which wire.status_error maps to a status once, in the server.
The models layer raises the engine's errors too (InvalidField, UnmetPrecondition for bad LoadModel fields); only
draft_config.py still reads a request message (DraftModel), so the layer as a whole may import the wire for now,
and every other models module may not (MODELS_READING_THE_WIRE). And no executor module imports another in a circle (at
run time: annotation-only imports cannot circle).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("selector_service", "executor_service", "gateway_service")
CLI = "specdec_cli"
TRAINING = "specdec_training"
GRPC = {"grpc", "grpc_status"}
# package -> the top-level modules it must not import
FORBIDDEN = {
    "selector_service": {"executor_service", "gateway_service", CLI, TRAINING, "torch", "triton"},
    "executor_service": {"selector_service", "gateway_service", CLI, TRAINING},
    # The gateway is a client of the executors over gRPC only: the protos and the shared runtime, no model code.
    "gateway_service": {
        *("executor_service", "selector_service", CLI, TRAINING, "selection", "kernels", "torch", "triton")
    },
    "specdec_runtime": {*SERVICES, CLI, TRAINING, "selection", "torch", "triton"},
    "selection": {*SERVICES, CLI, TRAINING, "torch", "triton"},
    "kernels": {*SERVICES, CLI, TRAINING, "specdec_runtime", "selection"},
    # An offline tool: no other service, no gRPC (the executor's modules it may use: training_violations).
    TRAINING: {"selector_service", "gateway_service", CLI, *GRPC},
}


def imported_packages(source: str) -> set[str]:
    """Top-level names of every absolute import in `source`, those inside functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def forbidden_imports(root: Path) -> list[str]:
    """'module imports package' for every import FORBIDDEN names, over the packages under `root`."""
    found = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            for name in sorted(imported_packages(path.read_text()) & forbidden):
                found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_no_service_imports_the_other() -> None:
    for package in FORBIDDEN:
        assert any((REPO_ROOT / package).rglob("*.py")), f"{package} has no modules: the layout changed"
    assert forbidden_imports(REPO_ROOT) == []


def test_the_check_sees_imports_anywhere_in_a_module(tmp_path: Path) -> None:
    """Negative control: imports at the top, inside a function and as `import a.b` are all found."""
    (tmp_path / "executor_service").mkdir()
    (tmp_path / "executor_service" / "late.py").write_text(
        "def f():\n    from selector_service.main import main\n    return main\n"
    )
    (tmp_path / "selection").mkdir()
    (tmp_path / "selection" / "top.py").write_text("import torch.nn\nfrom . import rules\n")
    assert forbidden_imports(tmp_path) == [
        "executor_service/late.py imports selector_service",
        "selection/top.py imports torch",
    ]


# ---- layers inside the executor -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    name: str
    wire_free: bool  # True: never imports WIRE
    modules: str  # module names under the package, space-separated; "pkg.*": every module of a sub-package


# Imports that carry the wire: the protobuf stubs and gRPC (specdec_runtime's errors are gRPC statuses).
WIRE = ("specdec", "specdec_runtime", "grpc", "grpc_status", "google.rpc", "google.protobuf")
EXECUTOR_LAYERS: tuple[Layer, ...] = (
    Layer(
        "base",
        wire_free=True,
        modules=(
            "__init__ errors cancellation daemon_thread load_phases models.__init__ models.attention_step "
            "models.fused_ops models.detokenizer runner.__init__ runner.step_constants sample.__init__ "
            "engine.__init__ spec_decode.__init__ server.__init__ parallel.__init__ parallel.channel "
            "parallel.stack_dumps parallel.rank_profile"
        ),
    ),
    Layer(
        "models",
        wire_free=False,
        modules=(
            "models.config models.json_fields models.limits models.rope models.rotary_cache models.fused_layer "
            "models.model models.weights models.loader models.model_loading models.model_paths models.gguf_loader "
            "models.gguf_tokenizer models.chat models.draft_config models.draft_models models.draft_weights "
            "models.draft_id_tables parallel.all_reduce parallel.fused_all_reduce parallel.state parallel.layers"
        ),
    ),
    Layer(
        "sampling",
        wire_free=True,
        modules=("sample.sampling sample.penalties sample.logprobs sample.hash_kernels sample.device_sampling"),
    ),
    Layer(
        "engine core",
        wire_free=True,
        modules=(
            "engine.request engine.block_pool engine.prefix_cache engine.kv_cache engine.scheduler engine.outcome"
        ),
    ),
    Layer(
        "runner",
        wire_free=True,
        modules=(
            "runner.model_runner runner.cuda_graphs runner.prefill_graphs runner.host_copy parallel.driver "
            "parallel.graphs parallel.protocol parallel.loading"
        ),
    ),
    Layer(
        "spec decode",
        wire_free=True,
        modules=(
            "spec_decode.device_penalties spec_decode.step_variants spec_decode.verifier spec_decode.host_verify "
            "spec_decode.draft_sampling spec_decode.draft_penalties spec_decode.tree_drafting spec_decode.proposer "
            "spec_decode.eagle_proposer spec_decode.dflash_proposer spec_decode.adaptive_measures "
            "spec_decode.acceptance_model spec_decode.adaptive_k spec_decode.spec_step spec_decode.deferred_context "
            "spec_decode.drafter_release"
        ),
    ),
    Layer(
        "engine",
        wire_free=True,
        modules=(
            "engine.engine_loop engine.engine engine.host_step engine.step_parts engine.overlap_decode "
            "engine.sampler_graphs engine.one_time_work engine.slow_steps runner.eager_warm_up"
        ),
    ),
    Layer(
        "server",
        wire_free=False,
        modules=(
            "server.servicer server.main server.validation server.wire server.prompt_intake "
            "server.sampling_checks server.stop_strings server.generate_stream server.server_info server.mailbox "
            "server.metrics server.selection server.capabilities server.session server.drafting "
            "server.backend_claims server.memory parallel.estimate parallel.launcher parallel.worker"
        ),
    ),
)


@dataclass(frozen=True)
class Import:
    name: str  # dotted, relative imports resolved: `import a.b` and `from a.b import c` give a.b
    annotations_only: bool  # under `if TYPE_CHECKING:`
    members: tuple[str, ...] = ()  # `from a.b import c, d`: c and d (modules or attributes)


def module_imports(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import of `module` (dotted; `is_package`: its source is the package's __init__), those inside
    functions included."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, annotations_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, annotations_only)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, annotations_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append(Import(name, annotations_only, tuple(alias.name for alias in node.names)))
        for child in ast.iter_child_nodes(node):
            visit(child, annotations_only)

    visit(ast.parse(source), False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Module name (relative to `package`, e.g. "parallel.state"; "__init__" for the package itself) -> file."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        found[".".join(path.relative_to(root / package).with_suffix("").parts)] = path
    return found


def package_graph(root: Path, package: str, annotations: bool = True, of: str | None = None) -> dict[str, set[str]]:
    """Which of the package's modules (or, with `of`, of that other package's) each one imports (relative names,
    as package_modules); `annotations`: imports under `if TYPE_CHECKING:` count too."""
    modules = package_modules(root, package)
    imported_package = of or package
    targets_of = package_modules(root, imported_package) if of else modules
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set()
        for found in module_imports(path.read_text(), _dotted(package, name), is_package=path.name == "__init__.py"):
            if found.annotations_only and not annotations:
                continue
            # `from a import b`: module a.b if there is one, else a (b is an attribute of a)
            members = [f"{found.name}.{m}" for m in found.members]
            targets = [m for m in members if _module(m, imported_package, targets_of)]
            if len(targets) < len(members) or not members:
                targets.append(found.name)
            resolved = (_module(t, imported_package, targets_of) for t in targets)
            imported.update(t for t in resolved if t and (of or t != name))
        graph[name] = imported
    return graph


def _dotted(package: str, name: str) -> str:
    return package if name == "__init__" else f"{package}.{name.removesuffix('.__init__')}"


def _module(dotted: str, package: str, modules: dict[str, Path]) -> str | None:
    """The package's module (relative name) that `dotted` names, a sub-package as its __init__; else None."""
    if dotted != package and not dotted.startswith(f"{package}."):
        return None
    relative = dotted.removeprefix(package).removeprefix(".")
    for candidate in (relative, f"{relative}.__init__" if relative else "__init__"):
        if candidate in modules:
            return candidate
    return None


def layer_of(layers: tuple[Layer, ...], module: str) -> list[int]:
    return [i for i, layer in enumerate(layers) if any(fnmatch(module, p) for p in layer.modules.split())]


def layer_violations(root: Path, package: str, layers: tuple[Layer, ...]) -> list[str]:
    """Every module in no layer or in several; every import of a higher layer's module; every wire import
    (WIRE) of a wire-free layer's module."""
    found = []
    modules = package_modules(root, package)
    graph = package_graph(root, package)
    for name, path in modules.items():
        where = layer_of(layers, name)
        if len(where) != 1:
            found.append(f"{name} is in {len(where)} layers")
            continue
        layer = layers[where[0]]
        for imported in sorted(graph[name]):
            their = layer_of(layers, imported)
            if len(their) == 1 and their[0] > where[0]:
                found.append(f"{name} ({layer.name}) imports {imported} ({layers[their[0]].name})")
        if layer.wire_free:
            dotted = f"{package}.{name}"
            names = {i.name for i in module_imports(path.read_text(), dotted, path.name == "__init__.py")}
            for wire in sorted(n for n in names if any(n == w or n.startswith(f"{w}.") for w in WIRE)):
                found.append(f"{name} ({layer.name}) imports {wire}")
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: each strongly connected component of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(cycles)


def test_the_executor_layers_hold() -> None:
    assert layer_violations(REPO_ROOT, "executor_service", EXECUTOR_LAYERS) == []


def test_no_executor_module_imports_another_in_a_circle() -> None:
    graph = package_graph(REPO_ROOT, "executor_service", annotations=False)
    assert len(graph) > 50, "the executor's modules were not found"
    assert import_cycles(graph) == []


# The models layer's modules that still import the wire (see the module's docstring); the others may not.
MODELS_READING_THE_WIRE = {"models.draft_config"}


def test_only_draft_config_reads_the_wire_in_the_models_layer() -> None:
    models = next(layer for layer in EXECUTOR_LAYERS if layer.name == "models")
    stricter = tuple(
        Layer(layer.name, True, " ".join(m for m in layer.modules.split() if m not in MODELS_READING_THE_WIRE))
        if layer is models
        else layer
        for layer in EXECUTOR_LAYERS
    )
    found = layer_violations(REPO_ROOT, "executor_service", stricter)
    assert found == [f"{m} is in 0 layers" for m in sorted(MODELS_READING_THE_WIRE)]


LAYERS_OF_THE_CONTROL = (
    Layer("low", wire_free=True, modules="plain fixed"),
    Layer("sub", wire_free=True, modules="sub.*"),
    Layer("high", wire_free=False, modules="__init__ shell"),
)


def test_the_layer_check_sees_upward_and_wire_imports(tmp_path: Path) -> None:
    """Negative control: an upward import (relative, in a function, or for annotations only), a stub and a gRPC
    import in a wire-free layer, and a module in no layer are all found; the allowed ones are not."""
    package = tmp_path / "made_up"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "shell.py").write_text("import grpc\nfrom made_up import plain\nfrom specdec.v1 import executor_pb2\n")
    (package / "plain.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from made_up.sub import deep\n"
        "def f():\n    from . import shell\n    return shell\n"
    )
    (package / "fixed.py").write_text("from made_up import plain\nfrom specdec_runtime.errors import FieldViolation\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "deep.py").write_text("from .. import fixed\nimport grpc.aio\n")
    (package / "stray.py").write_text("")
    assert layer_violations(tmp_path, "made_up", LAYERS_OF_THE_CONTROL) == [
        "fixed (low) imports specdec_runtime.errors",
        "plain (low) imports shell (high)",
        "plain (low) imports sub.deep (sub)",
        "stray is in 0 layers",
        "sub.deep (sub) imports grpc.aio",
    ]


def test_the_cycle_check_sees_circles(tmp_path: Path) -> None:
    """Negative control: a circle of three (one arrow inside a function), one of two through a package's
    __init__; an annotation-only arrow closes no circle at run time but does in the full graph."""
    package = tmp_path / "made_up"
    (package / "pkg").mkdir(parents=True)
    (package / "a.py").write_text("from made_up import b\n")
    (package / "b.py").write_text("def f():\n    from made_up.c import g\n    return g\n")
    (package / "c.py").write_text("import made_up.a\n")
    (package / "pkg" / "__init__.py").write_text("from made_up.pkg.inner import x\n")
    (package / "pkg" / "inner.py").write_text("from made_up import pkg\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from made_up import e\n")
    (package / "e.py").write_text("from made_up import d\n")
    assert import_cycles(package_graph(tmp_path, "made_up", annotations=False)) == [
        ["a", "b", "c"],
        ["pkg.__init__", "pkg.inner"],
    ]
    assert ["d", "e"] in import_cycles(package_graph(tmp_path, "made_up"))


# ---- who may use the executor's modules ------------------------------------------------------------------------------

# The executor's server-layer modules the trainer may use: the capability report the selection code decides from.
TRAINING_USES_OF_THE_SERVER = {"server.capabilities"}
STUBS = "specdec.v1"
# The trainer's modules that read the wire, and what each may import of it (dotted; `from specdec.v1 import x` is
# specdec.v1.x):
# - generation_engine: the selection library's request, built from this machine's capability report (datagen asks
#   the same selection code LoadModel does in-process for the target's attention backend);
# - init, recipes: draft_config's API takes a DraftModel of request overrides (an empty one: none), as long as
#   draft_config reads the wire (MODELS_READING_THE_WIRE);
# - cli: specdec_runtime's SpecdecError, which the selection code raises, reported as the command's error.
TRAINING_READING_THE_WIRE = {
    "generation_engine": {"specdec.v1.common_pb2", "specdec.v1.selector_pb2"},
    "init": {"specdec.v1.executor_pb2"},
    "recipes": {"specdec.v1.executor_pb2"},
    "cli": {"specdec_runtime.errors"},
}


def client_violations(
    root: Path,
    client: str,
    package: str,
    layers: tuple[Layer, ...],
    below: str,
    also: set[str],
    wire: dict[str, set[str]],
) -> list[str]:
    """What `client` imports of `package` beyond the modules of the layers below the layer named `below` and the
    modules in `also`; and every wire import (WIRE) of its modules beyond what `wire` grants each one."""
    top = next(i for i, layer in enumerate(layers) if layer.name == below)
    found = []
    for name, imported in package_graph(root, client, of=package).items():
        for module in sorted(imported):
            where = layer_of(layers, module)
            if module not in also and not (len(where) == 1 and where[0] < top):
                found.append(f"{name} imports {package}.{module}")
    for name, path in package_modules(root, client).items():
        granted = wire.get(name, set())
        for found_import in module_imports(path.read_text(), _dotted(client, name), path.name == "__init__.py"):
            names = [found_import.name]
            if found_import.name == STUBS:  # the stubs are modules of one package: each one is named
                names = [f"{STUBS}.{m}" for m in found_import.members] or names
            for dotted in names:
                wired = any(dotted == w or dotted.startswith(f"{w}.") for w in WIRE)
                if wired and not any(dotted == g or dotted.startswith(f"{g}.") for g in granted):
                    found.append(f"{name} imports {dotted}")
    return found


def test_the_trainer_uses_the_executor_below_its_server_and_the_wire_only_where_granted() -> None:
    assert len(package_modules(REPO_ROOT, TRAINING)) > 15, "the trainer's modules were not found"
    found = client_violations(
        REPO_ROOT,
        TRAINING,
        "executor_service",
        EXECUTOR_LAYERS,
        "server",
        TRAINING_USES_OF_THE_SERVER,
        TRAINING_READING_THE_WIRE,
    )
    assert found == []


def test_the_trainer_check_sees_the_composition_root_the_wire_and_the_shell(tmp_path: Path) -> None:
    """Negative control: the composition root (in a function), the wire module, a stub and a status error beyond
    the grant, and a module in no layer are all found; a model module, the engine, the one server module allowed
    and a granted stub are not."""
    executor = tmp_path / "made_up"
    executor.mkdir()
    for name in ("__init__", "model", "engine", "capabilities", "session", "wire", "stray"):
        (executor / f"{name}.py").write_text("")
    layers = (
        Layer("models", wire_free=False, modules="__init__ model"),
        Layer("engine", wire_free=True, modules="engine"),
        Layer("server", wire_free=False, modules="capabilities session wire"),
    )
    client = tmp_path / "tool"
    client.mkdir()
    (client / "__init__.py").write_text("")
    (client / "build.py").write_text(
        "from made_up import engine, model\nfrom made_up.capabilities import probe\n"
        "from specdec.v1 import common_pb2, executor_pb2\n"
        "def f():\n    from made_up.session import build_session\n    return build_session\n"
    )
    (client / "cli.py").write_text(
        "from made_up import wire\nfrom made_up.stray import x\nfrom specdec_runtime.errors import SpecdecError\n"
    )
    grant = {"build": {"specdec.v1.common_pb2"}}
    assert client_violations(tmp_path, "tool", "made_up", layers, "server", {"capabilities"}, grant) == [
        "build imports made_up.session",
        "cli imports made_up.stray",
        "cli imports made_up.wire",
        "build imports specdec.v1.executor_pb2",
        "cli imports specdec_runtime.errors",
    ]


def importers_of(root: Path, package: str, importers: str, imported: str) -> list[str]:
    """'a imports b' for every module of `package` matching the pattern `importers` that imports a module matching
    `imported` (relative names, fnmatch patterns; imports for annotations alone included)."""
    graph = package_graph(root, package)
    return [
        f"{name} imports {other}"
        for name in sorted(graph)
        if fnmatch(name, importers)
        for other in sorted(graph[name])
        if fnmatch(other, imported)
    ]


def test_no_tensor_parallel_module_imports_the_composition_root() -> None:
    assert "parallel.worker" in package_modules(REPO_ROOT, "executor_service"), "the ranks' module was not found"
    assert importers_of(REPO_ROOT, "executor_service", "parallel.*", "server.session") == []


def test_the_importer_check_sees_a_late_import_of_the_root(tmp_path: Path) -> None:
    """Negative control: a sub-package's module importing the root inside a function is found; the root importing
    the sub-package, and a module outside it importing the root, are not."""
    package = tmp_path / "made_up"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "rank.py").write_text("def load():\n    from made_up.root import load\n    return load()\n")
    (package / "root.py").write_text("from made_up.sub import rank\n")
    (package / "servicer.py").write_text("from made_up import root\n")
    assert importers_of(tmp_path, "made_up", "sub.*", "root") == ["sub.rank imports root"]
