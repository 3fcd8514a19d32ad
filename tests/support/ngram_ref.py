"""Prompt lookup's rule written plainly, the reference the n-gram and hybrid drafter tests hold the
device proposer to."""


def py_lookup(h: list, m: int, n_min: int, n_max: int):
    """(drafts, n, start): the K-1 = m tokens that followed the latest earlier occurrence of the
    history's last n tokens, n from n_max down to n_min (repeated with the match's period when fewer
    follow); no match: the last token m times, n = 0, start = 0."""
    L = len(h)
    for n in range(n_max, n_min - 1, -1):
        for j in range(L - n - 1, -1, -1):  # latest first; h[j + n] (the continuation) exists
            if h[j:j + n] == h[L - n:]:
                start = j + n
                return [h[start + i % (L - start)] for i in range(m)], n, start
    return [h[-1]] * m, 0, 0
