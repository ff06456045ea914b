"""Seeing runs: the forest viewer page (``treegrpo view``: :mod:`treegrpo.viz.data` reads,
:mod:`treegrpo.viz.page` writes one self-contained HTML file with ``viewer.js``/``viewer.css``
inlined) and the run plots (``treegrpo plot``: :mod:`treegrpo.viz.plots`)."""
