"""The batch split's reading of micro-batches that a loader object of the script's own class cuts:
``x, y = train_loader.next_batch()`` in ``for micro_step in range(grad_accum_steps):``, where ``train_loader =
DataLoaderLite(B=B, T=T, ...)`` (karpathy/build-nanogpt's and llm.c's ``train_gpt2.py``). The class keeps the size it
is built with (``self.B = B``), and each call cuts the next micro-batch from a position it advances::

    buf = self.tokens[self.current_position : self.current_position + B * T + 1]
    x = buf[:-1].view(B, T)
    self.current_position += B * T * self.num_processes

One call of a loader built with k x B cuts the tokens that k calls of one built with B cut one after another (in a
distributed run each rank cuts k neighbouring blocks, and the ranks together the same tokens in each optimizer step),
as long as the class reads its size only as a factor of a product (the cut's length, the advance, a rank's offset, the
test for the end of its data) and as the leading dimension of the ``view``/``reshape`` that shapes the micro-batch.
Where the class moves on at the end of its data (the next shard, or back to the start) as soon as the next
micro-batch no longer fits, the bigger one moves on up to k - 1 micro-batches earlier there. The split is made in the
training loader's constructor argument alone: an evaluation loader built with the same size keeps it."""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst
import libcst.matchers as m

from autotune.analysis import ModuleFacts
from autotune.syntax import assignments, is_reference, names_variable, scope_of
from autotune.transforms._split_reads import Refusal, factors, line_of, outermost_product, position_of

_METHOD_CALL = m.Call(func=m.Attribute(value=m.Name(), attr=m.Name()), args=[])
_SHAPES = ("view", "reshape")
_PRODUCT = m.BinaryOperation(operator=m.Multiply())


def _SELF(attribute: str) -> m.Attribute:  # noqa: N802 (a matcher, named as one)
    return m.Attribute(value=m.Name("self"), attr=m.Name(attribute))


class Loader(NamedTuple):
    """What the split of a loader object's micro-batches needs: the constructor's argument that gives the size, the
    statement that builds the loader (the split goes before it), the size as the object keeps it
    (``train_loader.B``), and whether the class moves on at the end of its data (what the report adds)."""

    argument: cst.Arg
    built: cst.BaseStatement
    kept: str
    moves_on: bool


def module_class(facts: ModuleFacts, name: str) -> cst.ClassDef | None:
    """The class ``name`` defined at the top level of the module."""
    return next((s for s in facts.module.body if isinstance(s, cst.ClassDef) and s.name.value == name), None)


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    return next((s for s in body if isinstance(s, cst.FunctionDef) and s.name.value == name), None)


def _bindings(facts: ModuleFacts, inner: cst.For, name: str) -> list[cst.Assign]:
    return assignments(facts, scope_of(facts, inner), name, unpacking=True) or \
        assignments(facts, facts.module, name, unpacking=True)


def _class_of(facts: ModuleFacts, value: cst.BaseExpression) -> cst.ClassDef | None:
    """The module's class that ``value`` builds (``DataLoaderLite(...)``), or None."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
        return module_class(facts, value.func.value)
    return None


def loader_call(facts: ModuleFacts, inner: cst.For) -> cst.Call | None:
    """``obj.method()`` in ``inner``'s body, where ``obj`` is built by a class of the module that defines ``method``
    (``train_loader.next_batch()``), or None."""
    for call in facts.nodes_in(inner.body, cst.Call):
        if not m.matches(call, _METHOD_CALL):
            continue
        classes = [c for a in _bindings(facts, inner, call.func.value.value) if (c := _class_of(facts, a.value))]
        if classes and _method(classes[0], call.func.attr.value) is not None:
            return call
    return None


def from_loader(facts: ModuleFacts, inner: cst.For, call: cst.Call, accumulation: cst.BaseExpression) -> Loader | Refusal:
    """The split of the micro-batches ``call`` (``train_loader.next_batch()`` in ``inner``) cuts, or why not."""
    obj, name = call.func.value.value, call.func.attr.value  # type: ignore[attr-defined]
    bound = _bindings(facts, inner, obj)
    if len(bound) != 1 or not isinstance(bound[0].value, cst.Call) or len(bound[0].targets) != 1:
        return Refusal(call, f"{obj} is bound {len(bound)} times: which loader cuts the micro-batches is not known")
    built = bound[0].value
    cls = _class_of(facts, built)
    if cls is None:
        return Refusal(built, f"{obj} is not built by a class of this module: how it cuts the micro-batches is not known")
    cls_name = cls.name.value
    init, method = _method(cls, "__init__"), _method(cls, name)
    size = _size_attribute(facts, method)
    if isinstance(size, Refusal):
        return size
    param = _stored_from(facts, cls, init, size)
    if isinstance(param, Refusal):
        return param
    reads = _class_reads(facts, cls, init, size, param)
    if isinstance(reads, Refusal):
        return reads
    refused = _cuts_and_advances(facts, cls, method, size)
    if refused is not None:
        return refused
    argument = _argument(init, built, param)
    if argument is None:
        return Refusal(built, f"{cls_name}(...) is not given {param} by name or position: the micro-batch size is not known")
    if not (is_reference(argument.value) or isinstance(argument.value, cst.Integer)):
        return Refusal(argument, (f"{cls_name}(...) is given {facts.code(argument.value)} as {param}: not a variable or "
                                  "option of the script's own"))
    kept = f"{obj}.{size}"
    refused = _object_uses(facts, inner, obj, name, kept, facts.code(accumulation), cls)
    if refused is not None:
        return refused
    statement = facts.statement_of(built)
    if facts.function_of(statement) is not facts.function_of(inner) or \
            position_of(facts, statement) >= position_of(facts, facts.statement_of(inner)):
        return Refusal(built, f"{obj} is not built in the training loop's function before the loop: where to split is not known")
    moves_on = any(facts.contains(if_.test, n) for if_ in facts.nodes_in(cls, cst.If) for n in reads)
    return Loader(argument, statement, kept, moves_on)


def _size_attribute(facts: ModuleFacts, method: cst.FunctionDef) -> str | Refusal:
    """``B`` of ``self.B``: the attribute that is the leading dimension of the ``view``/``reshape`` that shapes the
    micro-batches ``method`` returns, read directly or through a local name bound from it (``B, T = self.B, self.T``)."""
    aliases = _aliases(facts, method)
    found = set()
    for call in facts.nodes_in(method, cst.Call):
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value in _SHAPES and len(call.args) >= 2):
            continue
        first = call.args[0].value
        if m.matches(first, m.Attribute(value=m.Name("self"), attr=m.Name())):
            found.add(first.attr.value)
        elif isinstance(first, cst.Name) and first.value in aliases:
            found.add(aliases[first.value][0])
    if len(found) != 1:
        shown = " and ".join(sorted(f"self.{a}" for a in found)) or "no attribute"
        return Refusal(method, (f"{method.name.value}() shapes its micro-batches with {shown} as the leading dimension: "
                                "the micro-batch size is not known"))
    return found.pop()


def _aliases(facts: ModuleFacts, function: cst.FunctionDef) -> dict[str, tuple[str, cst.CSTNode]]:
    """Local names bound from ``self.<attribute>`` in ``function`` (``B = self.B``, ``B, T = self.B, self.T``): the
    attribute and the ``self.<attribute>`` node each is bound from."""
    out = {}
    for assign in facts.nodes_in(function, cst.Assign):
        for target in assign.targets:
            pairs = [(target.target, assign.value)]
            if isinstance(target.target, cst.Tuple) and isinstance(assign.value, cst.Tuple) and \
                    len(target.target.elements) == len(assign.value.elements):
                pairs = [(t.value, v.value) for t, v in zip(target.target.elements, assign.value.elements)]
            for t, v in pairs:
                if isinstance(t, cst.Name) and m.matches(v, m.Attribute(value=m.Name("self"), attr=m.Name())):
                    out[t.value] = (v.attr.value, v)
    return out


def _stored_from(facts: ModuleFacts, cls: cst.ClassDef, init: cst.FunctionDef | None, size: str) -> str | Refusal:
    """The parameter of ``__init__`` that ``self.<size>`` is set from, where that is its one binding in the class."""
    sets = [t for t in facts.nodes_in(cls, cst.AssignTarget) if m.matches(t.target, _SELF(size))]
    sets += [a for a in facts.nodes_in(cls, cst.AugAssign) if m.matches(a.target, _SELF(size))]
    params = [p.name.value for p in init.params.params[1:]] if init is not None else []
    assign = facts.parent(sets[0]) if len(sets) == 1 and isinstance(sets[0], cst.AssignTarget) else None
    if not (isinstance(assign, cst.Assign) and facts.contains(init, assign) and isinstance(assign.value, cst.Name)
            and assign.value.value in params and len(assign.targets) == 1):
        return Refusal(sets[0] if sets else cls, (f"self.{size} is not set once, from a parameter of {cls.name.value}'s "
                                                  "__init__: the micro-batch size is not known"))
    return assign.value.value


def _class_reads(facts: ModuleFacts, cls: cst.ClassDef, init: cst.FunctionDef, size: str,
                 param: str) -> list[cst.CSTNode] | Refusal:
    """Every read of the size in the class (``self.B``, a local name bound from it, ``__init__``'s parameter), each a
    factor of a product or the leading dimension of a ``view``/``reshape``; or the first read that is neither."""
    reads: list[cst.CSTNode] = []
    for function in facts.nodes_in(cls, cst.FunctionDef):
        bound_from = {a: source for a, (attr, source) in _aliases(facts, function).items() if attr == size}
        aliases = set(bound_from) | ({param} if function is init else set())
        found = [n for n in facts.nodes_in(function, cst.Attribute) if m.matches(n, _SELF(size))]
        found += [n for n in facts.nodes_in(function, cst.Name) if n.value in aliases and not _attribute_name(facts, n)]
        for node in sorted(found, key=facts.position):
            parent = facts.parent(node)
            if _bound_here(facts, parent) or any(node is v for v in bound_from.values()) or \
                    (function is init and _stores(facts, node, size)):
                continue  # ``B = self.B``, ``B, T = ...``, ``self.B = B``
            if m.matches(parent, _PRODUCT) or _leading(facts, node):
                reads.append(node)
                continue
            return Refusal(node, (f"{cls.name.value} reads {facts.code(node)} at line {line_of(facts, node)} other than as a "
                                  "factor of a product or the leading dimension of a view: one call with a bigger "
                                  "micro-batch may not cut what several smaller ones cut"))
    return reads


def _attribute_name(facts: ModuleFacts, node: cst.Name) -> bool:
    """``B`` of ``obj.B`` or the keyword of ``f(B=...)``: no read of a variable."""
    parent = facts.parent(node)
    return (isinstance(parent, cst.Attribute) and parent.attr is node) or \
        (isinstance(parent, (cst.Arg, cst.Param)) and getattr(parent, "keyword", None) is node) or \
        (isinstance(parent, cst.Param) and parent.name is node)


def _bound_here(facts: ModuleFacts, parent: cst.CSTNode) -> bool:
    """Whether ``parent`` (an AssignTarget, or an element of a tuple target) is where a name is bound."""
    if isinstance(parent, cst.AssignTarget):
        return True
    holder = facts.parent(parent)
    return isinstance(holder, cst.Tuple) and isinstance(facts.parent(holder), cst.AssignTarget)


def _stores(facts: ModuleFacts, node: cst.CSTNode, size: str) -> bool:
    """Whether ``node`` is the parameter in ``self.B = B``."""
    parent = facts.parent(node)
    return isinstance(parent, cst.Assign) and parent.value is node and any(
        m.matches(t.target, _SELF(size)) for t in parent.targets)


def _leading(facts: ModuleFacts, node: cst.CSTNode) -> bool:
    """Whether ``node`` is the first argument of ``x.view(...)``/``x.reshape(...)``."""
    arg = facts.parent(node)
    call = facts.parent(arg) if isinstance(arg, cst.Arg) else None
    return (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value in _SHAPES
            and call.args and call.args[0] is arg and arg.keyword is None)


def _cuts_and_advances(facts: ModuleFacts, cls: cst.ClassDef, method: cst.FunctionDef, size: str) -> Refusal | None:
    """The method cuts ``data[self.pos : self.pos + B * T (+ 1)]`` and advances ``self.pos += B * T``: one cut of k x
    B is then the k cuts of B that follow each other. In a distributed run it advances ``B * T * self.num_processes``
    and the position starts (and starts again) at ``B * T * self.process_rank``: each rank's k cuts become one of k
    neighbouring blocks, the ranks together the same tokens. Any other setting of the position, or another advance,
    and the cuts of a bigger micro-batch are not known."""
    aliases = {a: f"self.{attr}" for a, (attr, _) in _aliases(facts, method).items()}
    why = Refusal(method, (f"{method.name.value}() does not cut data[self.pos : self.pos + {size} * ...] and advance "
                           f"self.pos by that product: what a bigger micro-batch cuts is not known"))
    advances = [a for a in facts.nodes_in(method, cst.AugAssign) if isinstance(a.operator, cst.AddAssign)
                and m.matches(a.target, m.Attribute(m.Name("self"), m.Name())) and m.matches(a.value, _PRODUCT)]
    if len(advances) != 1:
        return why
    position, step = facts.code(advances[0].target), _normal(facts, advances[0].value, aliases)
    cuts = []
    for bounds in facts.nodes_in(method, cst.Slice):
        if bounds.lower is not None and facts.code(bounds.lower) == position and bounds.upper is not None:
            terms = _terms(bounds.upper)
            products = [t for t in terms if m.matches(t, _PRODUCT)]
            rest = [t for t in terms if t not in products and facts.code(t) != position]
            if len(products) == 1 and len(terms) - len(rest) == 2 and all(isinstance(t, cst.Integer) for t in rest):
                cuts.append(_normal(facts, products[0], aliases))
    if not cuts or any(c != cuts[0] for c in cuts) or f"self.{size}" not in cuts[0] or not cuts[0] <= step:
        return why
    spread = step - cuts[0]  # the processes that share the data: each advances past the others' cuts
    if len(spread) > 1 or any(not x.startswith("self.") for x in spread):
        return why
    for node in _settings_of(facts, cls, position):
        if isinstance(node, cst.AugAssign) and node is advances[0]:
            continue
        value = node.value if isinstance(node, cst.AugAssign) else facts.parent(facts.parent(node)).value
        where = facts.function_of(node)
        start = _normal(facts, value, {a: f"self.{attr}" for a, (attr, _) in _aliases(facts, where).items()}) \
            if m.matches(value, _PRODUCT) else None
        if isinstance(node, cst.AugAssign) or not (
                (isinstance(value, cst.Integer) and int(value.value) == 0 and not spread)
                or (start is not None and start > cuts[0] and len(start - cuts[0]) == 1 and spread
                    and not (start - cuts[0]) & spread)):
            return Refusal(node, (f"{position} is set at line {line_of(facts, node)} to {facts.code(value)}: not 0 nor a "
                                  "rank's offset of whole micro-batches, so where a bigger micro-batch is cut is not known"))
    return None


def _normal(facts: ModuleFacts, product: cst.CSTNode, aliases: dict[str, str]) -> frozenset[str]:
    """A product's factors, each local name bound from ``self.<attribute>`` written as that attribute."""
    return frozenset(aliases.get(f, f) for f in factors(facts, product))


def _settings_of(facts: ModuleFacts, cls: cst.ClassDef, position: str) -> list[cst.CSTNode]:
    """The targets of ``self.pos = ...`` and the ``self.pos += ...`` statements in the class."""
    sets: list[cst.CSTNode] = [t.target for t in facts.nodes_in(cls, cst.AssignTarget) if facts.code(t.target) == position]
    sets += [a for a in facts.nodes_in(cls, cst.AugAssign) if facts.code(a.target) == position]
    return sets


def _terms(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The terms of a sum (``a + b * c + 1``: a, b * c, 1)."""
    if m.matches(node, m.BinaryOperation(operator=m.Add())):
        return _terms(node.left) + _terms(node.right)
    return [node]


def _argument(init: cst.FunctionDef, built: cst.Call, param: str) -> cst.Arg | None:
    """The argument of the constructor call ``built`` that ``__init__`` takes as ``param``."""
    params = [p.name.value for p in init.params.params[1:]]
    for i, arg in enumerate(built.args):
        if arg.star:
            return None
        if (arg.keyword.value if arg.keyword is not None else (params[i] if i < len(params) else None)) == param:
            return arg
    return None


def _object_uses(facts: ModuleFacts, inner: cst.For, obj: str, name: str, kept: str, accumulation: str,
                 cls: cst.ClassDef) -> Refusal | None:
    """What else the script does with the loader object that the split could change. Left right: the cut in the
    micro-batch loop, a method called for its effect alone (``train_loader.reset()``), an attribute read but the size
    (where the position is at the start of an optimizer step it is where the original's would be), and the size in the
    samples per step (``train_loader.B * train_loader.T * grad_accum_steps``). Anything else (another cut, an attribute
    set from outside, the object given to a function) is a use whose outcome the split may change."""
    for node in facts.nodes_in(facts.module, cst.Name):
        if node.value != obj or facts.contains(cls, node) or not names_variable(facts, node):
            continue
        parent = facts.parent(node)
        if isinstance(parent, cst.AssignTarget):
            continue  # its binding
        line = line_of(facts, node)
        attribute = parent if isinstance(parent, cst.Attribute) and parent.value is node else None
        if attribute is None:
            return Refusal(node, f"{obj} is used at line {line} in a way not read here: what the split changes there is not known")
        use = facts.parent(attribute)
        if isinstance(use, cst.Call) and use.func is attribute:
            if attribute.attr.value == name and facts.contains(inner, attribute):
                continue
            if attribute.attr.value == name:
                return Refusal(use, (f"{obj}.{name}() is also called at line {line}: a bigger micro-batch would change what "
                                     "it cuts there, and what comes after"))
            if isinstance(facts.parent(use), cst.Expr):
                continue  # called for its effect: on the loader as split, like every other call
            return Refusal(use, f"{facts.code(use)} at line {line} returns what the split may change")
        if isinstance(use, (cst.AssignTarget, cst.AugAssign)) and use.target is attribute:
            return Refusal(attribute, f"{facts.code(attribute)} is set at line {line}: where {obj} cuts is not known")
        if facts.code(attribute) == kept:
            if accumulation not in factors(facts, outermost_product(facts, attribute)):
                return Refusal(attribute, f"{kept} is read at line {line}: the split would change it")
    return None
