// llava-tokenize: encodes each stdin line to ids (space-separated, as
// `spm_encode --output_format=id`), or with --decode turns id lines back into text.
#include <CLI/CLI.hpp>
#include <iostream>
#include <sstream>

#include "engine/io/tokenizer.h"

int main(int argc, char** argv) {
  CLI::App app{"SentencePiece BPE tokenizer (our implementation)"};
  std::string model;
  bool decode = false;
  app.add_option("--tokenizer", model, "tokenizer.model file")->required();
  app.add_flag("--decode", decode, "read id lines, print text");
  CLI11_PARSE(app, argc, argv);
  auto tok = llava::Tokenizer::Load(model);
  if (!tok.ok()) {
    std::cerr << "error: " << tok.status().ToString() << "\n";
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    if (decode) {
      std::istringstream in(line);
      std::vector<int> ids;
      int id;
      while (in >> id) ids.push_back(id);
      std::cout << (*tok)->Decode(ids) << "\n";
    } else {
      std::vector<int> ids = (*tok)->Encode(line);
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
      std::cout << "\n";
    }
  }
  return 0;
}
