// Declarations only: see gloo/context.h (ProcessGroupGloo.hpp includes this file but needs
// nothing from it).
#pragma once
