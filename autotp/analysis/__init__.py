"""Graph analysis: trace, op kinds, layer rule, layout propagation, local shapes. Imports only ``autotp.ir``.

Layout propagation: ``propagation`` (the walk), ``op_rules`` (the rule of every op, in
one table), ``sharding_policy`` (column/row/vocab/convolution), ``partials`` (all-reduce
placement), ``reshape_rules``, ``shape_rules``, ``index_rules``, ``statistic_rules`` and
``value_rules`` (the other rules), ``dtensor_rules`` (the fallback derived from DTensor's
strategies), ``propagation_result`` (what a walk returns), ``shapes`` (shape helpers).
"""
