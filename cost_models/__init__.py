"""Hardware specs, the simulated GPU and the profilers (installed as ``kareus_fx.cost_models``)."""
