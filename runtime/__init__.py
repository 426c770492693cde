"""What runs next to the GPU: streams, collectives, clocks, energy (installed as ``kareus_fx.runtime``)."""
