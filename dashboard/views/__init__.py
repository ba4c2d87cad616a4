"""The dashboard's views, one module per area; thin: parse, call a service or selector, render."""
