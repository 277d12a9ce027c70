"""The lab: what measures methods against each other, apart from the library that trains.

``thinwire compare`` races methods (:mod:`~thinwire.lab.compare`), ``thinwire cost`` predicts
their step time on a link (:mod:`~thinwire.lab.cost`), ``thinwire compare --suite`` checks
papers' claims (:mod:`~thinwire.lab.suite`), and ``thinwire bench`` times codecs, consensus
and memory (the ``bench_*`` modules). The lab imports the library; nothing in the library
imports the lab (tests/unit/test_layers.py).
"""
