#include "server/calibration_reader.h"

namespace oscarkv {

CalibrationReader DefaultCalibrationReader() { return nullptr; }

}  // namespace oscarkv
