"""pytest plugin of the conformance kit."""
