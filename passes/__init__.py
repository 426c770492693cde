"""Pure FX graph transformations and analyses (installed as ``kareus_fx.passes``)."""
