"""The Gemma family: Gemma-2 and Gemma-3's text model (:ref:`families-gemma`)."""
