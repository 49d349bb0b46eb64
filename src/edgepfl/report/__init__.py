"""Tables and plots from run directories."""
