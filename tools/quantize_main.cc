// llava-quantize: writes a llava-hf checkpoint folder with the decoder's linear layers
// quantized to int8 or int4 (engine/model/quantized_checkpoint.h has the file format), which
// llava-server, llava-generate and llava-eval then load without requantizing at start-up.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "engine/kernels/quant.h"
#include "engine/model/quantized_checkpoint.h"

int main(int argc, char** argv) {
  CLI::App app{"Quantize a LLaVA checkpoint's decoder weights (int8 | int4) into a new folder"};
  std::string model, out, weights = "int8";
  app.add_option("--model", model, "llava-hf model folder to read")->required();
  app.add_option("--out", out, "folder to write (created; must hold no .safetensors yet)")
      ->required();
  app.add_option("--weights", weights, "int8 | int4")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto format = llava::ParseWeightFormat(weights);
  if (!format.ok()) {
    std::cerr << "error: " << format.status().ToString() << "\n";
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  std::string summary;
  const llava::Status s = llava::WriteQuantizedCheckpoint(model, out, *format, &summary);
  if (!s.ok()) {
    std::cerr << "error: " << s.ToString() << "\n";
    return 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s; %.1f s\n", summary.c_str(), seconds);
  return 0;
}
