"""Compiler IR: the plan, layouts, node-meta keys, registered ops, schedule IR and rank groups.

Imports nothing else from autotp.
"""
