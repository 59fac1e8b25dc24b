"""Graph analysis: trace, layer rule, layout propagation, local shapes. Imports only ``autotp.ir``."""
