"""`stage1_text_encoder.py --plan`: stage 1's device programs (the text encoders, and for image-to-video the
image and VAE encoders) compiled for a TPU topology, as `--backend torchax` builds them.

Stage 1's own code runs: the family's prompt encoder and image encodes, with the real tokenizers and the
request's prompt and images, on a source whose models are built on the meta device (no weights placed) and
a runtime whose compiled modules compile each new call for the target's devices and hand back zeros of the
program's output shapes. So the programs compiled, and saved with `--save_executables`, are the ones a run
builds for that request, keyed as it keys them (tests/test_plan_executables.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NoReturn

import torch

from sharding import REPLICATED_TABLE, MeshShape
from tpu_video.cli import UserError
from tpu_video.engine.meta import meta_module, meta_pretrained
from tpu_video.planning.plan import Compiled, add_flops, base_report, compile_module
from tpu_video.planning.tpus import Target, topology_mesh
from tpu_video.runtime import placement
from tpu_video.runtime.torchax_runtime import TorchaxRuntime


class MetaSource:
    """A models.ModelSource whose models load on the meta device, as `load` would load them but without
    weights (diffusers': engine.meta.meta_module; transformers': engine.meta.meta_pretrained); tokenizers and
    processors load as they are. A published pipeline's configs (`configs_only`) carry no tokenizer files:
    the family's tiny preset's tokenizer stands in (`stand_ins` records which). Every family's pipeline pads
    the prompt to a fixed length, so the programs are the published model's; only the tokens differ."""

    def __init__(self, source, family) -> None:
        self.source, self.family = source, family
        self.stand_ins: dict[str, str] = {}  # component: the preset whose tokenizer stood in

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def _refuse(self, component: str) -> NoReturn:
        raise UserError(
            f"stage 1's --plan of {self.source.ref!r}: the configs kept in code for it have no {component!r} "
            "(only tokenizers have stand-ins); give the downloaded model's folder as --model"
        )

    def load(self, component: str, dtype=None):
        import diffusers
        import transformers

        if self.source.configs_only and component not in self.source.index:
            return self._stand_in(component)
        cls = self.source.component_class(component)
        if issubclass(cls, diffusers.ModelMixin):
            return meta_module(self.source, component, dtype)
        if issubclass(cls, transformers.PreTrainedModel):
            return meta_pretrained(self.source, component, dtype)
        return self.source.load(component, dtype)

    def _stand_in(self, component: str):
        import transformers

        from tpu_video import models

        for name in self.family.PRESETS:  # the first preset that has the component
            preset, _ = models.resolve_model(name)
            if component not in preset.index:
                continue
            if issubclass(preset.component_class(component), transformers.PreTrainedTokenizerBase):
                self.stand_ins[component] = name
                return preset.load(component)
            break
        self._refuse(component)


class _Input:
    """A CPU tensor a run would place on the mesh as `layout`: the plan compiles over its shape instead."""

    def __init__(self, tensor: torch.Tensor, layout) -> None:
        self.tensor, self.layout = tensor, layout


class PlanningRuntime(TorchaxRuntime):
    """Runs a stage's own code to find its programs: `compile` gives modules whose calls compile the program
    for the mesh's devices (once per input signature, saved to `store` if given) and return zeros of its
    outputs' shapes. Nothing is placed or run; `programs` lists what was compiled."""

    def __init__(self, mesh, store=None) -> None:
        super().__init__(mesh)
        self.store = store
        self.programs: list[dict[str, Any]] = []  # name, module, weight bytes per device, calls, Compiled

    def compile(self, module: torch.nn.Module, rules: Any = None, methods: tuple[str, ...] = ("forward",)):
        if callable(rules):
            rules = rules(dict(self.mesh.shape))
        if methods == ("forward",):
            return _Compiling(self, module, rules or REPLICATED_TABLE)
        weights = _weight_bytes(module, rules or REPLICATED_TABLE, self.mesh)  # once for all its programs
        calls = {name: _Compiling(self, module, rules or REPLICATED_TABLE, name, weights) for name in methods}
        return SimpleNamespace(**calls)  # each method its own program, as a run's compiled module

    def to_device(self, tree, layout: tuple | None = None):
        wrap = lambda value: _Input(value, layout or ()) if isinstance(value, torch.Tensor) else value  # noqa: E731
        return torch.utils._pytree.tree_map(wrap, tree)

    def to_host(self, tensor) -> torch.Tensor:
        return tensor.tensor if isinstance(tensor, _Input) else tensor  # the zeros a planned call returned


def _weight_bytes(module: torch.nn.Module, rules, mesh) -> int:
    """Bytes per device of the module's weights as placement lays them out (buffers replicated)."""
    total = 0
    for weight in placement.abstract_weights(module, rules, mesh).values():
        shard = weight.sharding.shard_shape(weight.shape)
        total += int(torch.Size(shard).numel()) * weight.dtype.itemsize
    return total


INNER = ("encoder", "vae", "connectors")  # where a compiled module (tpu_video/engine/encoders.py) holds the stock one


class _Compiling(torch.nn.Module):
    """A module's `method` as a planning runtime's `compile` returns it: each call with a new input signature is
    compiled (and saved); every call returns zeros shaped and laid out as the program's outputs (`to_host` gives
    the zeros; a later call given them compiles for that layout, as a run's does). It holds the module, as a
    run's compiled module does (pipelines ask for its parameters' dtype)."""

    def __init__(self, runtime: PlanningRuntime, module: torch.nn.Module, rules, method="forward", weights=None):
        super().__init__()
        self.module, self.rules, self.method = module, rules, method
        self.runtime = [runtime]  # not a submodule
        self.weights = _weight_bytes(module, rules, runtime.mesh) if weights is None else weights
        self.seen: dict[tuple, dict[str, Any]] = {}

    def forward(self, *args):
        from torchax.ops.mappings import j2t_dtype

        inputs = [(arg.tensor, arg.layout) if isinstance(arg, _Input) else (arg, ()) for arg in args]
        signature = tuple(
            (tuple(tensor.shape), tensor.dtype, layout) if isinstance(tensor, torch.Tensor) else tensor
            for tensor, layout in inputs
        )
        if signature not in self.seen:
            runtime = self.runtime[0]
            compiled = compile_module(
                self.module, self.rules, inputs, runtime.mesh, runtime.env, self.method, store=runtime.store
            )
            inner = next((getattr(self.module, name) for name in INNER if hasattr(self.module, name)), self.module)
            shapes = [str(list(tensor.shape)) for tensor, _ in inputs if isinstance(tensor, torch.Tensor)]
            method = "" if self.method == "forward" else f".{self.method}"
            if method and len(shapes) > 3:  # a chunk program: its input, then the cache the call before returned
                shapes = [shapes[0], f"{len(shapes) - 1} carried tensors"]
            shapes = ", ".join(shapes)
            name = f"{type(inner).__name__}{method} ({shapes})"
            module = id(self.module)  # its weights counted once, whatever its programs
            program = {"name": name, "module": module, "weights": self.weights, "calls": 0, "compiled": compiled}
            self.seen[signature] = program
            runtime.programs.append(self.seen[signature])
        program = self.seen[signature]
        program["calls"] += 1
        if program["compiled"].refused:
            raise _Refused(program)

        def zeros(output) -> _Input:  # laid out as the program returns it, for a call that takes it back (a cache)
            return _Input(torch.zeros(output.shape, dtype=j2t_dtype(output.dtype)), tuple(output.sharding.spec))

        outputs = program["compiled"].outputs
        return tuple(map(zeros, outputs)) if isinstance(outputs, tuple | list) else zeros(outputs)


class _Refused(Exception):
    """The compiler found a program too large for the device: the plan stops there."""

    def __init__(self, program: dict[str, Any]) -> None:
        super().__init__(program["name"])
        self.program = program


def plan_stage1(family, source, request, inputs: dict, dtype: torch.dtype, target: Target, store=None):
    """Compile stage 1's device programs for `request` (and its media `inputs`, where the family
    encodes them wholly on the runtime) on `target`, every device on `tp` as `--backend torchax` puts them;
    the report as a dict. Every encoder's weights stay
    on the devices while each program runs (a run loads them all first), so a program's HBM counts them all."""
    mesh = topology_mesh(target, MeshShape(tp=target.devices))
    runtime = PlanningRuntime(mesh, store)
    planning = MetaSource(source, family)
    images_planned = bool(inputs) and family.plans_inputs(source)
    try:
        with runtime.precision(dtype):
            family.prompt_encoder(planning, dtype, runtime)(request)
        if images_planned:
            with torch.no_grad(), runtime.precision(torch.float32):
                family.encode_inputs(planning, request, inputs, runtime)
    except _Refused:
        pass  # reported below, with what was compiled before it
    fields = {}
    if planning.stand_ins:
        fields["stand_ins"] = {component: f"{preset}'s tokenizer" for component, preset in planning.stand_ins.items()}
    if inputs and not images_planned:  # the family's plans_inputs says so
        fields["images"] = "not planned: this plan does not compile this model's image or video encodes yet"
    return programs_report(1, runtime, target, request, dtype, **fields)


def programs_report(stage: int, runtime: PlanningRuntime, target: Target, request, dtype, **fields) -> dict[str, Any]:
    """The plan of the programs `runtime` compiled (each module's weights resident while any program runs, as a
    run loads them all first): the largest program's verdict, each program's HBM, calls and collectives, and
    the FLOPs of all calls; the report stops at a program the compiler refused."""
    programs = runtime.programs
    resident = sum({p["module"]: p["weights"] for p in programs}.values())  # each module once, whatever its programs
    for program in programs:
        program["compiled"].add_resident(resident - program["weights"])

    def need(program) -> float:
        compiled: Compiled = program["compiled"]
        return compiled.refused["required"] if compiled.refused else compiled.memory["total"]

    largest = max(programs, key=need)
    fields = {"programs": [program["name"] for program in programs], "largest_program": largest["name"], **fields}
    report = base_report(stage, target, runtime.mesh, request, dtype, largest["compiled"], **fields)
    report["compile_seconds"] = round(sum(program["compiled"].seconds for program in programs), 1)
    if len({program["module"] for program in programs}) > 1:  # the other modules' weights, resident beside it
        report["hbm_bytes_per_device"]["other_encoders_weights"] = resident - largest["weights"]
    if any(program["compiled"].refused for program in programs):
        report["fits"] = False
        return report
    report["hbm_bytes_per_program"] = {program["name"]: need(program) for program in programs}
    report["calls"] = {program["name"]: program["calls"] for program in programs}
    report["collectives"] = {
        program["name"]: {op: value for op, value in program["compiled"].collectives.items() if value["count"]}
        for program in programs
    }
    add_flops(report, target, sum(program["compiled"].flops * program["calls"] for program in programs))
    return report
