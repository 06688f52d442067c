"""The OLMo-2 family: post-norm decoder layers whose q and k projections are RMS-normalised over
their whole width, built from the public blocks of :mod:`metrale.layers`."""
