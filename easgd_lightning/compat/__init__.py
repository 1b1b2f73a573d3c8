"""Adapters around the private APIs of the libraries we build on."""
