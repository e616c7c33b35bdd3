"""What every op family builds on: the backend registry (which kernel runs an
op on a device), the extension build, the accumulation-dtype rule, layout
helpers and the device-table cache. Nothing here imports an op family."""
