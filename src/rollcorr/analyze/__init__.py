"""``rollcorr analyze``: read rollout dumps (``rollcorr.dumps.read_dump``) and explain what a
correction config does to them (``rollcorr.analyze.analysis.analyze``), and show it
(``rollcorr.analyze.render``: ``render``, ``to_json``).

Nothing is imported here: ``rollcorr.cli`` imports ``rollcorr.analyze.cli`` to build its parser, and that
must not pull in torch.
"""
