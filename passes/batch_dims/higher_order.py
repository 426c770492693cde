"""Higher-order ops with a graph body: ``autograd_function_apply`` (a custom
``torch.autograd.Function``) and ``tag_activation_checkpoint``.

The body is analysed on its own (:class:`~.propagation.BatchAnalysis` in ``mode="body"``) with the
op's arguments' batch layouts, and each nanobatch's copy of the op calls its own copy of the body.
For an ``autograd.Function`` the backward body must give every batch-carrying input a gradient laid
out like it, and every shared input a nanobatch's part of a batch sum (autograd adds the parts of
the two nanobatch calls); a gradient of a shared input that does not depend on the batch would be
counted once per nanobatch and is refused. A checkpointed body is pure: autograd recomputes each
nanobatch's copy in its own backward.
"""

from __future__ import annotations

import torch.fx as fx

from kareus_fx.passes.batch_dims.propagation import BatchAnalysis, Body, register_batch_rule
from kareus_fx.passes.batch_dims.values import PARTIAL, BatchDim, Call, Step, Unsupported


@register_batch_rule("hop.autograd_function_apply")
def _rule_autograd_function(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``autograd_function_apply(fwd_body, bwd_body, *args)``: split both bodies per nanobatch.

    The forward body must be batch-separable. The backward body gets the forward outputs'
    gradients and the saved values; the gradient of a batch-carrying input must carry the batch
    the same way, and the gradient of a shared input must be a nanobatch's part of a batch sum
    (autograd adds the two nanobatches' parts).
    """
    fwd_attr, bwd_attr, *args = node.args
    fwd_target, bwd_target = _body_target(an, node, fwd_attr), _body_target(an, node, bwd_attr)
    fwd = getattr(an.gm, fwd_target)
    bwd = getattr(an.gm, bwd_target)
    arg_infos = [an.info(a) for a in args]
    fwd_an = _body_analysis(an, node, fwd, arg_infos)
    outs, saved = fwd_an.output_infos
    if not all(isinstance(o, BatchDim) for o in outs):
        raise an._fail(node, "an output of the autograd.Function does not carry the batch")
    bwd_an = _body_analysis(an, node, bwd, list(outs) + list(saved))
    grads = bwd_an.output_infos
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    bwd_out = list(bwd.graph.nodes)[-1].args[0]
    bwd_out = bwd_out if isinstance(bwd_out, (tuple, list)) else (bwd_out,)
    for a, ai, g, gn in zip(args, arg_infos, grads, bwd_out):
        if gn is None:
            continue
        if isinstance(ai, BatchDim) and g != ai:
            raise an._fail(node, f"the gradient of {a} does not carry the batch like {a}")
        if ai is None and g is not PARTIAL:
            raise an._fail(
                node,
                f"the gradient of shared input {a} does not depend on the batch "
                "(it would be counted once per nanobatch)",
            )

    def call(h: int) -> Call:
        return Call(
            node.op,
            node.target,
            (Body(fwd_target, fwd_an), Body(bwd_target, bwd_an), *args),
            dict(node.kwargs),
        )

    return Step(tuple(outs), True, call)


def _body_target(an: BatchAnalysis, node: fx.Node, body: object) -> str:
    """The attribute a higher-order op's body argument reads (it must be a ``get_attr`` node)."""
    if not isinstance(body, fx.Node) or body.op != "get_attr" or not isinstance(body.target, str):
        raise an._fail(node, f"body {body!r} is not a graph attribute")
    return body.target


@register_batch_rule("hop.tag_activation_checkpoint")
def _rule_checkpoint(an: BatchAnalysis, node: fx.Node, name: str) -> Step:
    """``tag_activation_checkpoint(body, *args)``: a pure body, split per nanobatch; autograd
    recomputes each nanobatch's body in its own backward."""
    body_attr, *args = node.args
    body_target = _body_target(an, node, body_attr)
    body_an = _body_analysis(an, node, getattr(an.gm, body_target), [an.info(a) for a in args])
    outs = body_an.output_infos
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    if not all(isinstance(o, BatchDim) for o in outs):
        raise an._fail(node, "an output of the checkpointed region does not carry the batch")
    return Step(
        outs, True, lambda h: Call(node.op, node.target, (Body(body_target, body_an), *args), dict(node.kwargs))
    )


def _body_analysis(an: BatchAnalysis, node: fx.Node, body: fx.GraphModule, infos: list) -> BatchAnalysis:
    phs = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(infos):
        raise an._fail(node, f"body {len(phs)} inputs for {len(infos)} values")
    vals = {n: n.meta.get("example_value") for n in body.graph.nodes}
    sub = BatchAnalysis(body, dict(zip(phs, infos)), vals, an.halves, mode="body", allow_rng=an.allow_rng)
    try:
        return sub.run()
    except Unsupported as e:
        raise an._fail(node, f"inside the autograd.Function: {e}") from None
