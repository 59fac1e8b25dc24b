"""Graph analysis: trace, op kinds, layer rule, layout propagation, local shapes. Imports only ``autotp.ir``.

Layout propagation: ``propagation`` (the walk), ``op_rules`` (the rule of every op, in
one table), ``sharding_policy`` (column/row/vocab), ``partials`` (all-reduce placement),
``shape_rules`` and ``value_rules`` (the other rules), ``propagation_result`` (what a
walk returns), ``shapes`` (shape helpers).
"""
