"""ONNX: the LSTM / GRU / RNN operators' initializers, a graph exporter and an importer.

One ONNX recurrent node is one layer, both directions (ONNX operators LSTM, GRU, RNN;
https://onnx.ai/onnx/operators/). Its tensors, per node:

    W  [D, G·H, I]     input weights        (rnnkit weight_ih per direction, gates reordered)
    R  [D, G·H, H]     recurrent weights    (weight_hh)
    B  [D, 2·G·H]      [W_b, R_b]           (bias_ih, bias_hh; a missing one is zeros)
    P  [D, 3·H]        peepholes i, o, f    (LSTM; rnnkit rows i, f, o)

Gate orders (docs/spec.md, "Gate orders elsewhere"): ONNX LSTM is i o f c, GRU z r h, RNN one
block; rnnkit is i f g o and r z n. Written as rnnkit's letters below ("iofg", "zrn").
Other correspondences: GRU ``linear_before_reset=1`` is ``reset_after=True``; LSTM
``input_forget=1`` is ``coupled_gates=True`` (f := 1 − i; the f blocks of W, R, B, P are
written as zeros and ignored on import); RNN ``activations=["Relu"]`` is
``nonlinearity="relu"``. ONNX zeroes Y past ``sequence_lens`` and its reverse direction
starts at each sequence's last valid step, as rnnkit does (checked with onnxruntime).

Not representable in ONNX, refused naming the option: proj_size / proj_clip (ONNX LSTM
has no projection), cell_clip (ONNX ``clip`` clips the gate pre-activations, not c),
layer_norm, zoneout. Supported beyond one node: stacked layers (chained nodes), per-layer
sizes, bidirectional with merge "concat" (Transpose + Reshape) or "sum" (ReduceSum),
variable lengths, initial states, batch_first (Transpose), every bias mode. A bfloat16
module exports a float32 model (its weights exactly; numpy, and onnxruntime's recurrent
kernels, have no bfloat16); a bfloat16 model imports through float32, into the module's
``dtype``.

On import the graph's tensors decide what the module computes. A model written by
`export` also carries the module's options in its metadata; its bias mode is used only
where the graph's B is zero in the half that mode drops, so a B edited after export is
imported whole (bias_mode "double").

Example:
    >>> rnnkit.interop.onnx.export(lstm, "lstm.onnx", include_lengths=True)
    >>> session = onnxruntime.InferenceSession("lstm.onnx")
    >>> y, h_n, c_n = session.run(None, {"input": x.numpy(), "lengths": lengths.numpy()})
    >>> lstm2 = rnnkit.interop.onnx.import_model("lstm.onnx")
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

import numpy as np

from ..spec import RNNSpec
from ._common import build_module, exported_pieces, imported_array, refuse, regate, rnnkit_gates, spec_of, suffix

ONNX_GATES = {"lstm": "iofg", "gru": "zrn", "rnn_tanh": "h", "rnn_relu": "h"}
ONNX_PEEPHOLES = "iof"
OP_TYPES = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"]}
METADATA_KEY = "rnnkit.spec"
MIN_OPSET = 14
FMT = "ONNX"


def _onnx():
    try:
        import onnx
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("rnnkit.interop.onnx needs the onnx package: pip install onnx") from error
    return onnx


def check_spec(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that ONNX cannot represent."""
    refuse("onnx", FMT, spec)


def peephole_rows(spec: RNNSpec) -> str:
    """rnnkit's peephole row letters: i, f, o (coupled: i, o)."""
    return "io" if spec.coupled_gates else "ifo"


# ---- initializers --------------------------------------------------------------------

def layer_tensors(module, layer: int) -> Dict[str, Optional[np.ndarray]]:
    """The W, R, B, P initializers of one layer's ONNX node (B, P None when absent)."""
    spec = spec_of(module)
    check_spec(spec)
    return _layer_tensors(spec, exported_pieces(module), layer)


def _layer_tensors(spec: RNNSpec, pieces: Dict[str, np.ndarray], layer: int) -> Dict[str, Optional[np.ndarray]]:
    ours, theirs = rnnkit_gates(spec), ONNX_GATES[spec.mode]
    cell = spec.cell(layer)
    gh = len(theirs) * cell.hidden_size
    W, R, B, P = [], [], [], []
    for direction in range(spec.num_directions):
        s = suffix(layer, direction)
        W.append(regate(pieces["weight_ih" + s], ours, theirs))
        R.append(regate(pieces["weight_hh" + s], ours, theirs))
        zeros = np.zeros(gh, dtype=W[-1].dtype)
        b_W = regate(pieces["bias_ih" + s], ours, theirs) if cell.has_bias_ih else zeros
        b_R = regate(pieces["bias_hh" + s], ours, theirs) if cell.has_bias_hh else zeros
        B.append(np.concatenate([b_W, b_R]))
        if cell.peephole:
            P.append(regate(pieces["weight_peephole" + s].reshape(-1), peephole_rows(spec), ONNX_PEEPHOLES))
    return {
        "W": np.stack(W),
        "R": np.stack(R),
        "B": np.stack(B) if cell.bias_mode != "none" else None,
        "P": np.stack(P) if P else None,
    }


# ---- export --------------------------------------------------------------------------

class _Graph:
    """Nodes, initializers and unique names of the graph under construction."""

    def __init__(self, helper, numpy_helper):
        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes, self.initializers = [], []
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def constant(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.initializers.append(self.numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: List[str], stem: str, outputs: int = 1, out_names=None, **attributes):
        names = out_names or [self.name(stem) for _ in range(outputs)]
        self.nodes.append(self.helper.make_node(op, inputs, names, name=self.name(op), **attributes))
        return names if outputs > 1 else names[0]


def export(
    module,
    path=None,
    *,
    opset: int = 17,
    include_lengths: bool = False,
    include_initial_state: bool = False,
    dynamic_axes: bool = True,
    sequence_length: int = 1,
    batch_size: int = 1,
):
    """Write ``module`` as an ONNX model of LSTM / GRU / RNN nodes and return the ModelProto.

    The model's inputs and outputs mean what the module's call means:

        input     (T, B, I), or (B, T, I) when the module is batch_first
        lengths   (B,) int64, when ``include_lengths``; values in [1, T]
        h_0, c_0  (L·D, B, Hr) and (L·D, B, H), when ``include_initial_state``
                  (per-layer sizes: h_0_l{k}, c_0_l{k}, each (D, B, ·))
        output    like the module's y
        h_n, c_n  like the module's h_n, c_n (per-layer sizes: h_n_l{k}, c_n_l{k})

    Args:
        module: an rnnkit LSTM, GRU or RNN.
        path: where to save the model (None: only return it).
        opset: the default-domain opset, at least 14.
        include_lengths: add the ``lengths`` input (ONNX ``sequence_lens``).
        include_initial_state: add the initial-state inputs (zeros otherwise).
        dynamic_axes: T and B are symbolic; otherwise fixed to ``sequence_length`` and
            ``batch_size``.

    A bfloat16 module gives a float32 model with the same weight values.

    Raises:
        ValueError: for an option ONNX cannot represent (see the module docstring).
    """
    onnx = _onnx()
    from onnx import TensorProto, helper, numpy_helper

    spec = spec_of(module)
    check_spec(spec)
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < MIN_OPSET:
        raise ValueError(f"opset: expected an int >= {MIN_OPSET}, got {opset!r}")
    pieces = exported_pieces(module)
    dtype = next(iter(pieces.values())).dtype
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    L, D = spec.num_layers, spec.num_directions
    T, B = ("T", "B") if dynamic_axes else (sequence_length, batch_size)
    lstm = spec.mode == "lstm"
    g = _Graph(helper, numpy_helper)

    inputs = [helper.make_tensor_value_info("input", elem, [B, T, spec.input_size] if spec.batch_first else [T, B, spec.input_size])]
    x = g.node("Transpose", ["input"], "x", perm=[1, 0, 2]) if spec.batch_first else "input"
    seq_lens = ""
    if include_lengths:
        inputs.append(helper.make_tensor_value_info("lengths", TensorProto.INT64, [B]))
        seq_lens = g.node("Cast", ["lengths"], "sequence_lens", to=TensorProto.INT32)

    def state_inputs(stem: str, sizes):
        """Per layer: the name of its initial state (D, B, size), or "" (zeros)."""
        if not include_initial_state:
            return [""] * L
        if spec.per_layer:
            for k in range(L):
                inputs.append(helper.make_tensor_value_info(f"{stem}_l{k}", elem, [D, B, sizes[k]]))
            return [f"{stem}_l{k}" for k in range(L)]
        inputs.append(helper.make_tensor_value_info(stem, elem, [L * D, B, sizes[0]]))
        if L == 1:
            return [stem]
        axes = g.constant("axes", np.array([0], np.int64))
        return [
            g.node("Slice", [stem, g.constant("start", np.array([k * D], np.int64)),
                             g.constant("end", np.array([(k + 1) * D], np.int64)), axes], f"{stem}_l{k}")
            for k in range(L)
        ]

    h0s = state_inputs("h_0", [spec.output_size(k) for k in range(L)])
    c0s = state_inputs("c_0", list(spec.hidden_sizes)) if lstm else None
    op = OP_TYPES[spec.mode]
    h_ns, c_ns = [], []
    for layer in range(L):
        t = _layer_tensors(spec, pieces, layer)
        names = [x, g.constant(f"W_l{layer}", t["W"]), g.constant(f"R_l{layer}", t["R"]),
                 g.constant(f"B_l{layer}", t["B"]) if t["B"] is not None else "", seq_lens, h0s[layer]]
        attributes = dict(hidden_size=spec.hidden_sizes[layer], direction="bidirectional" if D == 2 else "forward")
        if lstm:
            names += [c0s[layer], g.constant(f"P_l{layer}", t["P"]) if t["P"] is not None else ""]
            if spec.coupled_gates:
                attributes["input_forget"] = 1
        elif spec.mode == "gru":
            attributes["linear_before_reset"] = int(spec.reset_after)
        else:
            attributes["activations"] = ["Relu" if spec.mode == "rnn_relu" else "Tanh"] * D
        while names[-1] == "":
            names.pop()
        outs = g.node(op, names, f"{op}_l{layer}", outputs=3 if lstm else 2, **attributes)
        y = outs[0]  # [T, D, B, H]
        h_ns.append(outs[1])
        if lstm:
            c_ns.append(outs[2])
        if D == 1:
            x = g.node("Squeeze", [y, g.constant("axes", np.array([1], np.int64))], f"y_l{layer}")
        elif spec.merge == "concat":
            y = g.node("Transpose", [y], f"y_l{layer}", perm=[0, 2, 1, 3])  # [T, B, D, H]
            x = g.node("Reshape", [y, g.constant("shape", np.array([0, 0, -1], np.int64))], f"y_l{layer}")
        else:
            x = g.node("ReduceSum", [y, g.constant("axes", np.array([1], np.int64))], f"y_l{layer}", keepdims=0)

    feature = spec.output_feature_size
    g.node("Transpose" if spec.batch_first else "Identity", [x], "output", out_names=["output"],
           **({"perm": [1, 0, 2]} if spec.batch_first else {}))
    outputs = [helper.make_tensor_value_info("output", elem, [B, T, feature] if spec.batch_first else [T, B, feature])]

    def state_outputs(stem: str, states: List[str], sizes):
        if spec.per_layer:
            for k, state in enumerate(states):
                g.node("Identity", [state], stem, out_names=[f"{stem}_l{k}"])
                outputs.append(helper.make_tensor_value_info(f"{stem}_l{k}", elem, [D, B, sizes[k]]))
            return
        if L == 1:
            g.node("Identity", states, stem, out_names=[stem])
        else:
            g.node("Concat", states, stem, out_names=[stem], axis=0)
        outputs.append(helper.make_tensor_value_info(stem, elem, [L * D, B, sizes[0]]))

    state_outputs("h_n", h_ns, [spec.output_size(k) for k in range(L)])
    if lstm:
        state_outputs("c_n", c_ns, list(spec.hidden_sizes))

    graph = helper.make_graph(g.nodes, f"rnnkit_{spec.mode}", inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="rnnkit")
    model.ir_version = helper.find_min_ir_version_for(opsets)
    helper.set_model_props(model, {METADATA_KEY: json.dumps(spec.options())})
    onnx.checker.check_model(model)
    if path is not None:
        onnx.save(model, str(path))
    return model


# ---- import --------------------------------------------------------------------------

def _attributes(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(value):
    return value.decode() if isinstance(value, bytes) else value


RECURRENT_OPS = ("LSTM", "GRU", "RNN")


class _StackReader:
    """Walks an ONNX graph and accepts exactly a stack of recurrent nodes with the exporter's glue.

    Every tensor gets a tag saying what it holds; a node is accepted only when its inputs
    carry the tags its place in such a stack needs. The glue `export` writes:

        input  -> [Transpose 1,0,2: batch_first] -> node 0
        node k Y [T, D, B, H] -> Squeeze axis 1 (D = 1) | Transpose 0,2,1,3 + Reshape [0, 0, -1]
                 (merge "concat") | ReduceSum axis 1 (merge "sum") -> node k + 1, or the output
                 (through Identity, or Transpose 1,0,2 when batch_first)
        lengths -> [Cast] -> sequence_lens of every node
        h_0, c_0 -> [Slice of rows k·D .. (k+1)·D] -> initial_h, initial_c of node k
        Y_h, Y_c -> [Identity | Concat axis 0 of all layers] -> h_n, c_n

    A single node's raw outputs (Y [T, D, B, H], Y_h) may also be the graph's outputs, as
    other exporters write them. Anything else (an Add, a MatMul, a second branch) is
    refused, naming the node, since the imported module would compute something else.
    """

    def __init__(self, graph, values: Dict[str, np.ndarray]):
        self.values = values
        self.tags: Dict[str, tuple] = {name: ("const",) for name in values}
        for value in graph.input:
            if value.name not in values:
                self.tags[value.name] = ("input", value.name)
        self.nodes: List = []
        self.merges: Dict[int, str] = {}
        self.lengths = set()
        self.batch_first_in = False
        for node in graph.node:
            self._visit(node)
        if not self.nodes:
            raise ValueError("model: has no LSTM, GRU or RNN node")
        self.batch_first_out = None
        for output in graph.output:
            self._check_output(output.name)

    # ---- helpers ---------------------------------------------------------------------

    @staticmethod
    def _where(node) -> str:
        return f"node {node.name or node.output[0]!r} ({node.op_type})"

    def _refuse(self, node, why: str):
        raise ValueError(f"{self._where(node)}: {why}; rnnkit imports a plain stack of LSTM / GRU / RNN layers "
                         "(joined by the glue its exporter writes), and this graph computes something else")

    def _tag(self, name: str):
        return self.tags.get(name) if name else None

    def _ints(self, node, index: int, attribute: str):
        """An int list given as a constant input (new opsets) or as an attribute (old ones)."""
        if len(node.input) > index and node.input[index]:
            if node.input[index] not in self.values:
                self._refuse(node, f"its input {node.input[index]!r} is not a constant")
            return [int(v) for v in np.asarray(self.values[node.input[index]]).reshape(-1)]
        value = _attributes(node).get(attribute)
        return None if value is None else [int(v) for v in np.atleast_1d(value)]

    def _set(self, node, tag: tuple, index: int = 0) -> None:
        self.tags[node.output[index]] = tag

    # ---- nodes -----------------------------------------------------------------------

    def _visit(self, node) -> None:
        op, ins = node.op_type, [self._tag(name) for name in node.input]
        first = ins[0] if ins else None
        kind = first[0] if first else None
        if op == "Constant":
            self._set(node, ("const",))
        elif op in RECURRENT_OPS:
            self._recurrent(node, ins)
        elif op == "Identity":
            self._set(node, first)
        elif op == "Squeeze" and kind == "Y" and first[2] == 1 and self._ints(node, 1, "axes") == [1]:
            self._set(node, ("seq", first[1]))
            self.merges[first[1]] = "concat"
        elif op == "Transpose" and kind == "Y" and first[2] == 2 and _attributes(node).get("perm") == [0, 2, 1, 3]:
            self._set(node, ("Y_t", first[1]))
        elif op == "Reshape" and kind == "Y_t" and self._ints(node, 1, "shape") == [0, 0, -1]:
            self._set(node, ("seq", first[1]))
            self.merges[first[1]] = "concat"
        elif (op == "ReduceSum" and kind == "Y" and first[2] == 2 and self._ints(node, 1, "axes") == [1]
              and _attributes(node).get("keepdims", 1) == 0):
            self._set(node, ("seq", first[1]))
            self.merges[first[1]] = "sum"
        elif op == "Transpose" and kind == "input" and not self.nodes and _attributes(node).get("perm") == [1, 0, 2]:
            self._set(node, ("x", True))
        elif op == "Transpose" and kind == "seq" and _attributes(node).get("perm") == [1, 0, 2]:
            self._set(node, ("out", first[1], True))
        elif op == "Cast" and kind == "input":
            self._set(node, ("lengths", first[1]))
        elif op == "Slice" and kind == "input" and self._ints(node, 3, "axes") == [0]:
            self._set(node, ("state_in", first[1], self._ints(node, 1, "starts")[0], self._ints(node, 2, "ends")[0]))
        elif op == "Concat" and ins and all(t is not None and t[0] == "state" for t in ins) \
                and _attributes(node).get("axis") == 0:
            which = {t[2] for t in ins}
            if len(which) != 1 or [t[1] for t in ins] != list(range(len(ins))):
                self._refuse(node, "it concatenates states other than every layer's, in order")
            self._set(node, ("states", which.pop(), len(ins)))
        else:
            self._refuse(node, "it is not part of a recurrent stack")

    def _recurrent(self, node, ins) -> None:
        k = len(self.nodes)
        a = _attributes(node)
        D = 2 if _decode(a.get("direction", "forward")) == "bidirectional" else 1
        x = ins[0]
        if k == 0 and x is not None and x[0] == "input":
            pass
        elif k == 0 and x is not None and x[0] == "x":
            self.batch_first_in = x[1]
        elif k > 0 and x == ("seq", k - 1):
            pass
        else:
            expected = "the graph's input" if k == 0 else f"the output of node {self._where(self.nodes[-1])}"
            self._refuse(node, f"its input X is not {expected} (through the exporter's Transpose / Squeeze / "
                               "Reshape / ReduceSum)")
        if a.get("layout", 0) != 0 and k > 0:
            self._refuse(node, "layout=1 (batch-major) in a stack; rnnkit's exporter chains time-major nodes")
        weight_inputs = (1, 2, 3, 7) if node.op_type == "LSTM" else (1, 2, 3)
        for index in weight_inputs:
            tag = ins[index] if index < len(ins) else None
            if len(node.input) > index and node.input[index] and tag != ("const",):
                self._refuse(node, f"its weight input {node.input[index]!r} is not an initializer or Constant")
        lengths = ins[4] if len(ins) > 4 else None
        if lengths is not None and lengths[0] not in ("input", "lengths"):
            self._refuse(node, "its sequence_lens is not a graph input (or its Cast)")
        self.lengths.add(None if lengths is None else lengths[1])
        if len(self.lengths) > 1:
            self._refuse(node, "its sequence_lens differs from the other layers'")
        for index in (5, 6) if node.op_type == "LSTM" else (5,):
            state = ins[index] if index < len(ins) else None
            if state is None or state[0] == "input":
                continue
            if state[0] != "state_in" or (state[2], state[3]) != (k * D, (k + 1) * D):
                self._refuse(node, f"its initial state {node.input[index]!r} is not rows {k * D}:{(k + 1) * D} "
                                   "of a graph input")
        self.nodes.append(node)
        layout = a.get("layout", 0)
        outputs = [("Y", k, D) if layout == 0 else ("Y_batch_major", k), ("state", k, "h"), ("state", k, "c")]
        for index, name in enumerate(node.output):
            if name:
                self.tags[name] = outputs[index]

    def _check_output(self, name: str) -> None:
        tag, last = self.tags.get(name), len(self.nodes) - 1
        ok = tag is not None and (
            (tag[0] in ("seq", "Y", "Y_batch_major") and tag[1] == last)
            or (tag[0] == "out" and tag[1] == last)
            or tag[0] == "state"
            or (tag[0] == "states" and tag[2] == last + 1)
        )
        if not ok:
            raise ValueError(f"model: the graph output {name!r} is not the stack's output sequence or final state "
                             "(rnnkit imports a plain stack of LSTM / GRU / RNN layers)")
        if tag[0] == "out":
            self.batch_first_out = tag[2]
        elif tag[0] == "seq":
            self.batch_first_out = False
        if tag[0] == "Y_batch_major" and len(self.nodes) > 1:
            raise ValueError("model: batch-major (layout=1) nodes in a stack; rnnkit's exporter chains time-major ones")


def import_model(model, *, batch_first: Optional[bool] = None, dtype=None):
    """Build an rnnkit module from an ONNX model that is one stack of LSTM / GRU / RNN nodes.

    The graph must be exactly such a stack: node k + 1 reads node k's output through the
    glue `export` writes (Squeeze, Transpose + Reshape, ReduceSum), the input and
    output may be transposed (batch_first), lengths cast, initial states sliced, final
    states concatenated; W, R, B, P must be initializers (or Constant nodes). A single
    node whose raw outputs are the graph's outputs (as other exporters write) imports
    too. Merge ("concat" / "sum") and batch_first are read from the glue; a model written
    by `export` also carries its options in its metadata, whose bias mode is taken only
    where the graph's B holds zeros in the half that mode drops (else "double": the graph
    wins).

    Args:
        model: a path or an ``onnx.ModelProto`` (not modified).
        batch_first: override the module's input layout.
        dtype: the module's dtype (default float32).

    Raises:
        ValueError: naming the node, for any node that is not part of such a stack (an
            Add, a MatMul, a branch), for a node attribute rnnkit cannot represent
            (clip, non-default activations, direction="reverse", mixed operator types),
            and for a W, R, B or P of the wrong shape (naming the input, expected and got).
    """
    onnx = _onnx()
    from onnx import numpy_helper

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    graph = model.graph
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            attributes = _attributes(node)
            if "value" in attributes:
                values[node.output[0]] = numpy_helper.to_array(attributes["value"])
    stack = _StackReader(graph, values)
    nodes = stack.nodes
    op = nodes[0].op_type
    if any(n.op_type != op for n in nodes):
        raise ValueError(f"model: mixes recurrent operators {sorted({n.op_type for n in nodes})}; rnnkit stacks one kind")

    def tensor(node, index: int):
        if len(node.input) <= index or node.input[index] == "":
            return None
        return imported_array(values[node.input[index]], node.input[index])

    layers = []
    for node in nodes:
        a = {k: _decode(v) for k, v in _attributes(node).items()}
        for refused in ("clip", "activation_alpha", "activation_beta"):
            if refused in a:
                raise ValueError(f"{refused}: node {node.name!r} sets it; rnnkit has no such option "
                                 "(ONNX clip clips the gate pre-activations, rnnkit's cell_clip clips c)")
        activations = [_decode(v) for v in a.get("activations", [])]
        direction = a.get("direction", "forward")
        if direction == "reverse":
            raise ValueError(f"direction: node {node.name!r} runs reverse only; rnnkit has forward and bidirectional")
        D = 2 if direction == "bidirectional" else 1
        if op == "RNN":
            kinds = set(activations or ["Tanh"])
            if kinds not in ({"Tanh"}, {"Relu"}):
                raise ValueError(f"activations: node {node.name!r} has {activations}; rnnkit's RNN is Tanh or Relu")
            mode = "rnn_relu" if kinds == {"Relu"} else "rnn_tanh"
        else:
            mode = op.lower()
            if activations and activations != DEFAULT_ACTIVATIONS[op] * D:
                raise ValueError(f"activations: node {node.name!r} has {activations}; rnnkit uses "
                                 f"{DEFAULT_ACTIVATIONS[op]}")
        W, R = tensor(node, 1), tensor(node, 2)
        if W is None or R is None:
            raise ValueError(f"W, R: node {node.name!r} lacks its weights")
        for name, index, value in (("W", 1, W), ("R", 2, R)):
            if value.ndim != 3:
                raise ValueError(f"{name}: {_StackReader._where(node)} input {node.input[index]!r} expected a 3-D "
                                 f"tensor [num_directions, gates·hidden_size, ·], got shape {value.shape}")
        layers.append(dict(
            node=node, mode=mode, D=D, W=W, R=R, B=tensor(node, 3),
            P=tensor(node, 7) if op == "LSTM" else None,
            hidden=int(a.get("hidden_size", R.shape[-1])),
            coupled=bool(a.get("input_forget", 0)),
            reset_after=bool(a.get("linear_before_reset", 0)) if op == "GRU" else True,
            batch_major=a.get("layout", 0) != 0,
        ))

    first = layers[0]
    for key in ("mode", "D", "coupled", "reset_after"):
        if any(layer[key] != first[key] for layer in layers):
            raise ValueError(f"model: the recurrent nodes differ in {key}; rnnkit stacks identical layers")
    peephole = [layer["P"] is not None for layer in layers]
    if any(peephole) and not all(peephole):
        raise ValueError("P: some LSTM nodes have peepholes and some do not; rnnkit stacks identical layers")
    stored = {}
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            stored = json.loads(prop.value)
    merges = set(stack.merges.values()) if first["D"] == 2 else set()
    if len(merges) > 1:
        raise ValueError("merge: the layers' outputs are merged both by concatenation and by sum; "
                         "rnnkit's layers share one merge")
    merge = merges.pop() if merges else stored.get("merge", "concat")
    # a Transpose of the graph's input and a batch-major node (layout=1) cancel: the input is time-major
    glue_batch_first = stack.batch_first_in != first["batch_major"]
    if stack.batch_first_out is not None and stack.batch_first_out != glue_batch_first:
        raise ValueError("batch_first: the graph's input and output sequences have different layouts; "
                         "an rnnkit module reads and writes one")
    hidden = [layer["hidden"] for layer in layers]
    options = dict(
        bidirectional=first["D"] == 2,
        merge=merge,
        peephole=all(peephole),
        coupled_gates=first["coupled"],
        reset_after=first["reset_after"],
        batch_first=bool(glue_batch_first if batch_first is None else batch_first),
    )
    listed = stored.get("per_layer") or isinstance(stored.get("hidden_size"), list) or len(set(hidden)) > 1
    sizes = (first["mode"], int(first["W"].shape[-1]), hidden if listed else hidden[0], len(layers))
    pieces = _pieces_from_layers(RNNSpec(*sizes, bias_mode="double", **options), layers)
    general = "double" if any(layer["B"] is not None for layer in layers) else "none"
    bias_mode = stored.get("bias_mode", general)
    if not _drops_only_zeros(pieces, bias_mode):  # B edited after export: the graph's biases win
        bias_mode = general
    spec = RNNSpec(*sizes, bias_mode=bias_mode, dropout=stored.get("dropout", 0.0), **options)
    dropped = DROPPED_BIASES[bias_mode]  # zeros (checked above) the module has no place for
    return build_module(spec, {name: value for name, value in pieces.items() if not name.startswith(dropped)}, dtype)


DROPPED_BIASES = {"double": (), "single_input": ("bias_hh",), "single_recurrent": ("bias_ih",),
                  "none": ("bias_ih", "bias_hh")}


def _drops_only_zeros(pieces: Dict[str, np.ndarray], bias_mode: str) -> bool:
    """Whether every bias piece that ``bias_mode`` has no place for is zero."""
    dropped = DROPPED_BIASES.get(bias_mode, ())
    return not any(np.any(value) for name, value in pieces.items() if name.startswith(dropped))


def _pieces_from_layers(spec: RNNSpec, layers: List[dict]) -> Dict[str, np.ndarray]:
    ours, theirs = rnnkit_gates(spec), ONNX_GATES[spec.mode]
    pieces = {}
    for k, layer in enumerate(layers):
        cell = spec.cell(k)
        gh = len(theirs) * cell.hidden_size
        D, G, node = spec.num_directions, len(theirs), layer["node"]
        expected = {"W": (1, (D, gh, cell.input_size), f"[{D}, {G}·{cell.hidden_size}, {cell.input_size}]"),
                    "R": (2, (D, gh, cell.hidden_size), f"[{D}, {G}·{cell.hidden_size}, {cell.hidden_size}]"),
                    "B": (3, (D, 2 * gh), f"[{D}, 2·{G}·{cell.hidden_size}]"),
                    "P": (7, (D, len(ONNX_PEEPHOLES) * cell.hidden_size), f"[{D}, 3·{cell.hidden_size}]")}
        for name, (index, shape, formula) in expected.items():
            value = layer[name]
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name}: {_StackReader._where(node)} input {node.input[index]!r} expected shape "
                                 f"{formula} = {shape}, got {tuple(value.shape)}")
        for direction in range(spec.num_directions):
            s = suffix(k, direction)
            pieces["weight_ih" + s] = regate(layer["W"][direction], theirs, ours)
            pieces["weight_hh" + s] = regate(layer["R"][direction], theirs, ours)
            b = layer["B"][direction] if layer["B"] is not None else np.zeros(2 * gh, np.float32)
            if cell.has_bias_ih:
                pieces["bias_ih" + s] = regate(b[:gh], theirs, ours)
            if cell.has_bias_hh:
                pieces["bias_hh" + s] = regate(b[gh:], theirs, ours)
            if spec.peephole:
                rows = regate(layer["P"][direction], ONNX_PEEPHOLES, peephole_rows(spec))
                pieces["weight_peephole" + s] = rows.reshape(len(peephole_rows(spec)), cell.hidden_size)
    return pieces
