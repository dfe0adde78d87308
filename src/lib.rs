//! inferlb
