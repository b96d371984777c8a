"""Namespace colours: a look per namespace, none repeated among those on one screen."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.access.roles import Role
from controlplane.dashboard.looks import HUES, LOOKS, look_class, namespace_looks, preferred_look
from tests.dashboard.builders import make_node, pod, signed_in
from tests.pods import gpu_container

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)


@given(st.sets(names, max_size=LOOKS))
def test_up_to_24_namespaces_never_share_a_look(namespaces: set[str]) -> None:
    looks = namespace_looks(namespaces)
    assert set(looks) == namespaces
    assert len(set(looks.values())) == len(namespaces)
    assert all(0 <= v < LOOKS for v in looks.values())


@given(st.sets(names, max_size=HUES))
def test_up_to_8_namespaces_never_share_a_colour(namespaces: set[str]) -> None:
    hues = {look % HUES for look in namespace_looks(namespaces).values()}
    assert len(hues) == len(namespaces)
    assert all(look < HUES for look in namespace_looks(namespaces).values())  # plain, no pattern


@given(st.sets(names, min_size=HUES, max_size=LOOKS))
def test_every_hue_is_used_before_any_pattern(namespaces: set[str]) -> None:
    looks = sorted(namespace_looks(namespaces).values())
    assert set(range(HUES)) <= set(looks)


@given(st.sets(names, max_size=40), st.randoms())
def test_the_looks_depend_on_the_set_not_its_order(namespaces: set[str], rng) -> None:
    shuffled = list(namespaces)
    rng.shuffle(shuffled)
    assert namespace_looks(shuffled) == namespace_looks(sorted(namespaces))


def test_a_namespace_without_a_rival_keeps_its_look_on_every_screen() -> None:
    alone = preferred_look("team-a")
    # others that prefer every hue but team-a's, several of them the same one
    others = [n for n in (f"ns-{i}" for i in range(200)) if preferred_look(n) != alone][:12]
    assert namespace_looks(["team-a"])["team-a"] == alone
    assert namespace_looks(["team-a", *others])["team-a"] == alone


def test_two_namespaces_that_prefer_one_hue_get_two_hues() -> None:
    first = "team-a"
    rival = next(
        n for n in (f"ns-{i}" for i in range(1000)) if preferred_look(n) == preferred_look(first)
    )
    looks = namespace_looks([first, rival])
    keeper, mover = sorted((first, rival))
    assert looks[keeper] == preferred_look(keeper)  # the smaller name keeps its own
    # a pattern on one hue would tell them apart only up close: they get two colours
    assert looks[first] % HUES != looks[rival] % HUES
    assert look_class(looks[mover]).endswith(" p0")


def test_past_24_namespaces_looks_repeat_but_every_one_has_one() -> None:
    many = [f"ns-{i}" for i in range(30)]
    looks = namespace_looks(many)
    assert set(looks) == set(many) and len(set(looks.values())) == LOOKS


@pytest.mark.django_db
def test_the_nodes_page_gives_its_namespaces_distinct_looks_in_bars_and_legend() -> None:
    make_node("n1", cards=4, memory_mib=81920)
    # three namespaces that all prefer one hue
    base = "team-a"
    rival, same = [
        n for n in (f"ns-{i}" for i in range(1000)) if preferred_look(n) == preferred_look(base)
    ][:2]
    for i, ns in enumerate((base, rival, same)):
        pod(f"p{i}", "n1", gpu_container("app", mem=1024, cores=10), namespace=ns)
    body = signed_in(Role.VIEWER).get("/nodes/").content.decode()
    seg = {
        ns: re.search(rf'class="seg (h\d p\d)" data-width="[\d.]+" data-pod="{ns}/', body).group(1)
        for ns in (base, rival, same)
    }
    assert len(set(seg.values())) == 3, seg
    assert len({css.split()[0] for css in seg.values()}) == 3, seg  # three hues, not patterns
    legend = body[body.index('class="nslegend"') :]
    for ns, css in seg.items():
        assert f'<i class="swatch {css}"></i>{ns}</span>' in legend
