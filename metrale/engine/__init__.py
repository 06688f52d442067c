"""Request handling: sampling and the generation loop."""
