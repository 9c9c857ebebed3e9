"""Plain references shared by the tests: the expert matmul slot by slot, and the routing patterns it is tried on."""

import torch


def expert_matmul(x, weight, indices, scores, s_out):
    """out[n, s // (S/S_out)] += scores[n, e] * x[n, s // (S/S_in)] @ weight[e], e = indices[n, s], one slot at a
    time, in x's dtype; differentiable, so its gradients are references too."""
    n_tokens, s_in = x.shape[:2]
    slots = indices.shape[1]
    rows = []
    for n in range(n_tokens):
        groups = [x.new_zeros(weight.shape[2]) for _ in range(s_out)]
        for s in range(slots):
            e = int(indices[n, s])
            term = x[n, s // (slots // s_in)] @ weight[e]
            if scores is not None:
                term = scores[n, e] * term
            groups[s // (slots // s_out)] = groups[s // (slots // s_out)] + term
        rows.append(torch.stack(groups))
    return torch.stack(rows)


ROUTINGS = ("random", "two-experts", "one-expert", "all-experts")


def routing(pattern: str, n_tokens: int, n_experts: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """[N, S] expert indices: uniform; only experts 0 and 2 (the others get no slot); every slot to the last
    expert; or k = E, each token using every expert once in its own order."""
    if pattern == "random":
        return torch.randint(0, n_experts, (n_tokens, slots), generator=gen)
    if pattern == "two-experts":
        return torch.tensor([0, 2])[torch.randint(0, 2, (n_tokens, slots), generator=gen)]
    if pattern == "one-expert":
        return torch.full((n_tokens, slots), n_experts - 1)
    if pattern == "all-experts":
        assert slots == n_experts, "k = E"
        return torch.stack([torch.randperm(n_experts, generator=gen) for _ in range(n_tokens)])
    raise ValueError(pattern)
