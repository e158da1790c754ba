//! CubeCL kernels for glm5-burn.
//!
//! Empty for now: the pure-Burn reference paths live in `glm5_burn::ops` and are the
//! oracle these kernels will be tested against (see the kernel issue).
