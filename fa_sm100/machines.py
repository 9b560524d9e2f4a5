"""The machines the defaults were measured on, in one place: the SM counts a config or a
cross-compile assumes where there is no device to ask (with one, ``fa_sm100.devices.sm_count``
answers, and the interfaces fit persistent grids to it)."""

B200_SMS = 148  # SM100: the SM100 defaults, cross-compiles and emulation without a device
HOPPER_SMS = 132  # H100 SXM and H200: the Hopper defaults' persistent grids
